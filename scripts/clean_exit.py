"""A user's torchrun script with a split GRU, ending as PyTorch documents (issue 49, item 5; docs/distributed.md,
"A clean exit"): every rank must exit 0.  The runs of docs/measurements.md (2026-12-01) are of this script:

    for i in $(seq 200); do torchrun --standalone --nproc-per-node 3 scripts/clean_exit.py || echo "run $i: $?"; done

3 gloo ranks, T = 50 split over them, forward and backward in fp64; each rank prints whether its output, ∇x and
∇W_hh match torch.nn.GRU's autograd on the whole sequence; the model and its outputs stay module globals, as in a
user's script.
"""

import torch
import torch.distributed as dist

import bppsa.nn
from bppsa.distributed.launch import init_from_env

init_from_env("gloo", timeout=120)
torch.set_num_threads(1)
p, r = dist.get_world_size(), dist.get_rank()
torch.manual_seed(0)
T, B, I, H = 50, 4, 6, 8
x = torch.randn(T, B, I, dtype=torch.float64)
gru = bppsa.nn.GRU(I, H, process_group=dist.group.WORLD, group_timeout=60).double()
ref = torch.nn.GRU(I, H).double()
ref.load_state_dict(gru.state_dict())
x_mine = torch.tensor_split(x, p)[r].clone().requires_grad_(True)
out, h_n = gru(x_mine)
out.sum().backward()
xr = x.clone().requires_grad_(True)
ro, _ = ref(xr)
ro.sum().backward()
sl = torch.tensor_split(torch.arange(T), p)[r]
ok = torch.allclose(out, ro[sl], atol=1e-10) and torch.allclose(x_mine.grad, xr.grad[sl], atol=1e-10) and \
    torch.allclose(gru.weight_hh_l0.grad, ref.weight_hh_l0.grad, atol=1e-10)
print(f"rank {r}: results {'ok' if ok else 'WRONG'}", flush=True)
dist.barrier()
dist.destroy_process_group()
