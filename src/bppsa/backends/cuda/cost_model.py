"""A cost model of the GPU backward: bytes, FLOP and launches counted from the launch plan, and a time
predicted from a GPU's published peaks.

Each layout is the list of steps one backward runs on the GPU (:func:`steps`):

* ``faithful`` -- the paper's design: every per-step Jacobian written to global memory (the paper layout's
  fill for the RNN, torch's Jacobian build for the GRU), then one launch per level of the Blelloch scan
  (:func:`.plan.scan_plan`), then the parameter gradients as torch GEMMs over the scan's output;
* ``factored`` -- the chain kept as its factors (:class:`bppsa.backends.chain.RnnChain`,
  ``GruChain``, built by torch), then the chunked kernels of :func:`.plan.factored_plan`, which never
  write a per-step Jacobian and sum the parameter gradients as they replay the chain.

A kernel's ``moved`` and ``flop`` come from its :class:`.plan.Launch`; torch's own kernels (the factors,
the GRU's gates and Jacobians, the faithful path's GEMMs) are counted here per tensor pass, as one step
with the number of kernels torch launches for it.  A step takes

    max(bytes / bandwidth, FLOP / peak) / fill + kernels x launch overhead,

where ``fill = min(1, threads launched / (SMs x resident threads per SM))`` charges a launch too small
to occupy the GPU with the idle part of it.  The peaks are the vendors' published figures (:data:`GPUS`),
not measurements; the launch overhead (:data:`LAUNCH_S`) is an assumed typical value, an option of
``bppsa gpu-model``.  A real kernel reaches some fraction of either peak, so this prediction
(``predicted_s``) is a floor: ``scripts/gpu_reference.sh`` measures the same layouts and writes achieved
against predicted.

The expected time (``expected_s``, :func:`expected`) adds what the floor leaves out and what the first GPU run
(H200, 2026-11-26) showed to dominate today's kernels:

* **a shared-load ceiling**: a kernel issues ``Step.lds_per_fma`` shared loads per multiply-add (``LDS_PER_FMA`` = 2
  in the kernels that read both operands from shared memory; itemsize / (16 NC) in the register up kernel, whose
  16-byte loads of W^T feed NC columns, :meth:`Step.of`), and an SM serves ``SMEM_BYTES_PER_CLK`` bytes of shared
  loads a clock, so FLOP/s <= 2 x that rate / (loads per FMA x itemsize);
* **per-step latency**: a block that walks ``serial`` dependent steps (the factored kernels' C steps of a chunk;
  one product per block in the Blelloch kernels) takes at least ``serial`` x the step's latency per wave of
  blocks (:data:`STEP_S`: a global load of the step's factors, the barriers, the H-long chain of dependent
  multiply-adds).  The register up kernel's step is its issue chain instead (:func:`_issue_latency`: NW H² NC
  multiply-adds at ``ISSUE_PER_FMA`` instructions, one a clock per scheduler, ``SCHEDULERS_PER_SM`` shared by the
  SM's warps) -- assumptions, not fits (the one run that shows the kernel's device time alone, T = 30,000 on the
  H200, took 1.85x the modelled device time of the backward);
* **per-launch host latency**: each CuPy launch (:data:`HOST_LAUNCH_S`: packing pointers and np.int64 arguments)
  and each torch kernel (:data:`HOST_TORCH_S`) costs the host time, and the backward's Python glue
  (:data:`HOST_FIXED_S`, :data:`GLUE_TORCH_OPS`) comes first; the device runs a step once the host has issued it
  and the previous step is done, so at small shapes the host's time is the backward's time.

Those constants are fit to the H200 runs (``results/reference/nvidia-h200/``, 2026-11-27's):
``tests/test_gpu_model.py`` holds the expected times of the kernels it ran to those measurements within 1.5x,
planning as the code does.  A backward captured in a CUDA graph (no host work per launch) is
``host=False`` (:func:`graphed`: ``graph_s``, each phase's time, the dominant phase).

The same model chooses the factored plan's chunk size (:func:`chunk_size`: the least expected device time of the
plan's kernels, :func:`chunk_cost`), so what it predicts is what the backend runs.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ...jacobians.recurrent import num_jacobians
from . import plan

LAUNCH_S = 3e-6  # assumed per-kernel launch overhead on a busy stream (not a published figure)

# The expected time's terms (see the module docstring).  SMEM_BYTES_PER_CLK is the hardware's (32 banks of 4 bytes
# a clock per SM, Volta to Hopper); the rest are fit to the H200 runs (tests/test_gpu_model.py).
SMEM_BYTES_PER_CLK = 128
LDS_PER_FMA = 2.0  # the shared-memory kernels: both operands of every multiply-add loaded from shared memory
# The register up kernel (factored_up.cu): assumptions, not fits (docs/gpu-first-run.md says how they compare).
LDS_BYTES = 16  # its shared loads are 16-byte vectors of W^T, each feeding 16 / itemsize rows of its NC columns
SCHEDULERS_PER_SM = 4  # warp schedulers per SM, each issuing one warp instruction a clock (Volta to Hopper)
ISSUE_PER_FMA = 1.35  # instructions a warp issues per multiply-add of its step loop (the FMAs, the LDS.128 of
#                       W^T, the streamed factor loads and their addresses), read from its SASS, not timed
STEP_S = {"mm": 4.0e-6, "mv": 2.0e-6}  # latency of one dependent step of a block at H = 20 (scales with H / 20)
# The one-launch middle phase (factored_warp.cu): assumptions, not fits (no GPU has run it); see _middle_clocks.
GLOBAL_LATENCY_S = 0.5e-6  # a load that misses L1 (between Hopper's L2 and HBM latencies, ~0.25 and ~0.5 µs)
FMA_DEP_CLK = {4: 4, 8: 8}  # clocks from one dependent multiply-add to the next (fp32, fp64)
STAGE_CLK = 40  # a staging's fixed cost per transition: two __syncwarp and the address arithmetic
HOST_LAUNCH_S = 25e-6  # host time of one CuPy RawKernel launch from Python
HOST_TORCH_S = 25e-6  # host time of one eager torch op (Python, dispatch, launch)
HOST_FIXED_S = 600e-6  # the backward's Python glue outside any op (autograd, the layer's routing, plans, checks)
# eager torch ops of a backward that no Step counts (the head, permutes, contiguous copies, cat of the gradients)
GLUE_TORCH_OPS = {("factored", "rnn"): 20, ("factored", "gru"): 35, ("faithful", "rnn"): 15, ("faithful", "gru"): 25}


@dataclass(frozen=True)
class Gpu:
    """Published peaks: memory bandwidth (GB/s), non-tensor-core FP32 and FP64 throughput (TFLOP/s), SMs and
    resident threads per SM, and where the figures come from."""

    name: str
    bandwidth_GBps: float
    fp32_TFLOPs: float
    fp64_TFLOPs: float
    sms: int = 0
    threads_per_sm: int = 2048
    source: str = ""
    clock_GHz: float = 0.0  # boost clock: the shared-load ceiling's rate (0: unknown, no ceiling)

    def peak_flops(self, itemsize: int) -> float:
        return (self.fp64_TFLOPs if itemsize == 8 else self.fp32_TFLOPs) * 1e12


GPUS = {
    "rtx2070": Gpu("RTX 2070", 448, 7.46, 0.233, 36, 1024, "NVIDIA Turing TU106 spec: 2304 cores at 1620 MHz boost",
                   1.62),
    "rtx2080ti": Gpu("RTX 2080 Ti", 616, 13.45, 0.420, 68, 1024,
                     "NVIDIA Turing TU102 spec: 4352 cores at 1545 MHz boost", 1.545),
    "v100": Gpu("V100 SXM2", 900, 15.7, 7.8, 80, 2048, "NVIDIA V100 datasheet", 1.53),
    "a100": Gpu("A100 SXM4 80 GB", 2039, 19.5, 9.7, 108, 2048, "NVIDIA A100 datasheet (FP64 without tensor cores)",
                1.41),
    "h100": Gpu("H100 SXM5", 3350, 67.0, 34.0, 132, 2048, "NVIDIA H100 datasheet (SXM5, non-tensor-core)", 1.98),
    "h200": Gpu("H200 SXM", 4800, 67.0, 34.0, 132, 2048, "NVIDIA H200 datasheet (SXM, non-tensor-core)", 1.98),
}


# substrings of torch.cuda.get_device_name() -> the table's key, most specific first
_DEVICE_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("V100", "v100"), ("2080 Ti", "rtx2080ti"),
                 ("2070", "rtx2070"))


def key_for_device_name(name: str) -> str | None:
    """The :data:`GPUS` key of a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100"); None for a GPU the
    table lacks, or a variant with other peaks (a PCIe H100 or A100) -- give those as numbers."""
    if "PCIe" in name or "NVL" in name:
        return None
    return next((key for sub, key in _DEVICE_NAMES if sub in name), None)


def parse_gpu(spec: str) -> Gpu:
    """A name of :data:`GPUS` (case, spaces, dashes and underscores ignored: "H100", "rtx-2080-ti") or numbers
    ``GBps:FP32_TFLOPs[:FP64_TFLOPs[:SMs]]`` (e.g. ``3350:67:34:132``); raises ValueError naming the choices."""
    key = re.sub(r"[\s_\-]", "", spec.lower())
    if key in GPUS:
        return GPUS[key]
    parts = spec.split(":")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        nums = []
    if not 2 <= len(nums) <= 4 or min(nums) <= 0:
        raise ValueError(f"--gpu {spec!r}: a name ({', '.join(GPUS)}) or GBps:FP32_TFLOPs[:FP64_TFLOPs[:SMs]] "
                         "with positive numbers")
    bw, f32 = nums[0], nums[1]
    f64 = nums[2] if len(nums) > 2 else f32 / 2
    sms = int(nums[3]) if len(nums) > 3 else 0
    return Gpu(f"custom {spec}", bw, f32, f64, sms, 2048, "given on the command line")


@dataclass(frozen=True)
class Step:
    """One step of a layout: a kernel of the plan (``kernels`` = 1, its grid and block) or a torch pass
    (``kernels`` torch launches, treated as filling the GPU); ``moved`` in elements, ``flop``."""

    name: str
    kernels: int
    threads: int  # threads per launch (0: a torch pass, assumed to fill the GPU)
    moved: int
    flop: int
    serial: int = 0  # dependent steps each block walks one after the other (0: none, element-wise)
    step: str = ""  # their kind: "mm" (an H x H product a step) or "mv" (a mat-vec a step)
    block: int = 0  # threads per block
    lds_per_fma: float = LDS_PER_FMA  # shared loads per multiply-add of its inner loop
    fma_per_step: int = 0  # multiply-adds one thread issues per dependent step (0: the step takes STEP_S[step])
    seconds: float = 0.0  # the launch's dependent chain where it is modelled in clocks (the middle kernel)

    @classmethod
    def of(cls, launch: plan.Launch, itemsize: int = 4, gpu: Gpu | None = None) -> Step:
        if launch.kernel.startswith("torch."):
            return cls(launch.kernel, 1, 0, launch.moved, launch.flop)
        if launch.kernel == "bppsa_factored_middle":  # ints: n, B, H, I, C, ...; one block per batch element
            n, H, C = launch.ints[0], launch.ints[2], launch.ints[4]
            g = GPUS[CHUNK_GPU] if gpu is None else gpu
            secs = _middle_clocks(-(-n // C), H, itemsize, launch.block // 32, g) / (g.clock_GHz * 1e9) \
                if g.clock_GHz and g.sms else 0.0
            # its hottest loop, a composition: one 16-byte broadcast load of the staged aggregate per 16 / itemsize FMAs
            return cls(launch.kernel, 1, launch.grid * launch.block, launch.moved, launch.flop, block=launch.block,
                       lds_per_fma=itemsize / LDS_BYTES, seconds=secs)
        serial, step, lds, fma_step = 0, "", LDS_PER_FMA, 0
        if launch.kernel.startswith("bppsa_factored_down_warp_"):  # ints n, B, H, I, C, ..., mode; a warp per pair
            g = GPUS[CHUNK_GPU] if gpu is None else gpu
            secs = _down_warp_seconds(launch, itemsize, g)
            # a step's 16-byte broadcast loads (t_g, the column values) per its multiply-adds (mat-vec, the sums)
            H, I = launch.ints[2], launch.ints[3]
            nw, nbv, v = (1, I + 1 + H, LDS_BYTES // itemsize) if "_rnn" in launch.kernel else (3, I + 1 + H,
                                                                                              LDS_BYTES // itemsize)
            nacc = nbv if nw == 1 else 3 * nbv + 1
            lds = (nw * -(-H // v) + -(-nbv // v)) / (nw * H + nacc)
            return cls(launch.kernel, 1, launch.grid * launch.block, launch.moved, launch.flop, block=launch.block,
                       lds_per_fma=lds, seconds=secs)
        if launch.kernel == "bppsa_factored_grads":  # ints: parts, entries, total
            # a warp adds every GRADS_WARPS-th part, two loads an iteration; assumed: GRADS_IN_FLIGHT iterations' loads
            # in flight, each round a global load's latency
            rounds = 1 + launch.ints[0] / (2 * plan.GRADS_WARPS * GRADS_IN_FLIGHT)
            secs = rounds * GLOBAL_LATENCY_S
            return cls(launch.kernel, 1, launch.grid * launch.block, launch.moved, launch.flop, block=launch.block,
                       lds_per_fma=0.0, seconds=secs)
        if launch.consts:  # the register up kernel (factored_up.cu): ints n, B, H, I, C, ...
            H, C = launch.ints[2], launch.ints[4]
            nc = dict(launch.consts)["BPPSA_NC64" if itemsize == 8 else "BPPSA_NC32"]
            nw = plan.FACTORED_KINDS[launch.kernel.rsplit("_", 1)[1]][0]
            # a thread's chunk: its first step builds the Jacobian's columns, each later one multiplies them,
            # NW·H² multiply-adds per column; one 16-byte load of W^T feeds (16 / itemsize) rows of its NC columns
            serial, step, lds, fma_step = C - 1, "mm", itemsize / (LDS_BYTES * nc), nw * H * H * nc
        elif launch.kernel.startswith("bppsa_factored_"):  # ints: n, B, H, I, C, ...: a block walks C steps
            serial, step = launch.ints[4], "mm" if "_up_" in launch.kernel else "mv"
        elif launch.kernel in ("bppsa_up_sweep", "bppsa_down_sweep", "bppsa_middle_scan"):
            serial, step = 1, "mm" if launch.kernel == "bppsa_up_sweep" else "mv"
        return cls(launch.kernel, 1, launch.grid * launch.block, launch.moved, launch.flop, serial, step,
                   launch.block, lds, fma_step)


def _cell(cell: str, H: int, I: int) -> tuple[int, int]:
    """(gate rows NA of the parameter gradients, factor rows NR per step) of the chain classes."""
    if cell == "rnn":
        return H, 2 * H + I
    if cell == "gru":
        return 4 * H, 6 * H + I
    raise ValueError(f"cell must be 'rnn' or 'gru', got {cell!r}")


def _gates(T: int, B: int, H: int, I: int) -> Step:
    """The GRU's gates recomputed (:func:`bppsa.jacobians.gru.gru_gates`): two GEMMs (x and h' read, 2 x 3H
    written), the sigmoid pass (2H read twice, 2H written), the candidate's pass (3H read, H written)."""
    rows = T * B
    return Step("torch.gru_gates", 5, 0, rows * (I + H + 6 * H + 6 * H + 4 * H),
                2 * rows * 3 * H * (I + H) + rows * 10 * H)


def steps(layout: str, cell: str, T: int, B: int, H: int, I: int, itemsize: int = 4, gpu: Gpu | None = None
          ) -> list[Step]:
    """What one backward runs on the GPU for ``layout`` ("faithful" or "factored"); see the module docstring.  The
    factored plan's chunk size is :func:`chunk_size`'s for ``gpu`` as the backend plans it (a GPU of :data:`GPUS`;
    any other as an H100), its up kernel the one the plan takes for ``itemsize``."""
    NA, NR = _cell(cell, H, I)
    rows = T * B
    grads_cols = I + 1 + H
    out: list[Step] = []
    if layout == "faithful":
        if cell == "rnn":
            out.append(Step.of(plan.rnn_jacobians_launch(T, B, H, "paper")))
            n = num_jacobians(T, "paper")
        else:
            out.append(_gates(T, B, H, I))
            # gru_jacobians_t: the coefficients (a few [T, B, H] passes), then J written by a mul, read and
            # written by two addcmuls, its diagonal by an add.
            HH = H * H
            out.append(Step("torch.gru_jacobians", 9, 0, rows * (12 * H) + rows * HH * 5 + rows * 2 * H,
                            rows * (12 * H + 5 * HH)))
            n = T
        out += [Step.of(launch) for launch in plan.scan_plan(n + 1, B, H)[1]]
        # The parameter gradients from the scan's output: the gates' gradients (elementwise, reading the
        # factors they need), then GEMMs over the T·B rows reading them and (x, h') once each.
        out.append(Step("torch.param_grads", 4 if cell == "rnn" else 8, 0,
                        rows * (H + NA + NA + I + H) + NA * grads_cols,
                        rows * (NA + 2 * NA * grads_cols)))
        return out
    if layout == "factored":
        if cell == "rnn":
            # RnnChain.from_states: d = 1 - h² (h read, d written), x and h' copied into the factor rows.
            out.append(Step("torch.rnn_factors", 4, 0, rows * (H + H + 2 * (I + H)), rows * 2 * H))
        elif GRU_FACTOR_KERNEL:  # one kernel from the forward's states (issue 41)
            out.append(Step.of(plan.gru_factors_launch(T, B, H, I), itemsize, gpu))
        else:  # torch's gates and factor passes (the H200 runs of 2026-11-26 and -27)
            out.append(_gates(T, B, H, I))
            out.append(Step("torch.gru_factors", 8, 0, rows * (12 * H + NR + I + H), rows * 12 * H))
        C = chunk_size(cell, T, B, H, I, itemsize, gpu if gpu in GPUS.values() else None)
        g = gpu if gpu in GPUS.values() else None
        warps = middle_warps(-(-T // C), H, itemsize, g)
        out += [Step.of(launch, itemsize, g)
                for launch in plan.factored_plan(cell, T, B, H, I, C, itemsize=itemsize, warps=warps)[1]]
        return out
    raise ValueError(f"layout must be 'faithful' or 'factored', got {layout!r}")


LAYOUTS = ("faithful", "factored")
# (variant, GPU backend) -> the layout it runs: cupy-factored sends the paper layout to the faithful kernels.  Every
# GPU backend of bppsa.backends.BACKENDS has its rows here (tests/test_extension_points.py).
LAYOUT_OF = {("bppsa-paper", "cupy"): "faithful", ("bppsa-paper", "cupy-factored"): "faithful",
             ("bppsa-fused", "cupy-factored"): "factored"}


def predict(layout: str, cell: str, T: int, B: int, H: int, I: int, itemsize: int, gpu: Gpu,
            launch_s: float = LAUNCH_S) -> dict:
    """One layout's totals and predicted seconds on ``gpu`` (the keys ``bppsa gpu-model --json`` prints)."""
    st = steps(layout, cell, T, B, H, I, itemsize, gpu)
    bw, peak = gpu.bandwidth_GBps * 1e9, gpu.peak_flops(itemsize)
    seconds = 0.0
    for s in st:
        fill = _fill(s, gpu)
        seconds += max(s.moved * itemsize / bw, s.flop / peak) / fill + s.kernels * launch_s
    kernel_steps = [s for s in st if s.threads]
    return {
        "layout": layout, "cell": cell, "seq_len": T, "batch": B, "hidden": H, "input": I,
        "dtype": {4: "float32", 8: "float64"}[itemsize], "gpu": gpu.name,
        "bytes": sum(s.moved for s in st) * itemsize,
        "flop": sum(s.flop for s in st),
        "launches": sum(s.kernels for s in st),
        "max_threads_per_launch": max((s.threads for s in kernel_steps), default=0),
        "min_threads_per_launch": min((s.threads for s in kernel_steps), default=0),
        "predicted_s": seconds,
        **expected(layout, cell, T, B, H, I, itemsize, gpu, launch_s),
        **graphed(layout, cell, T, B, H, I, itemsize, gpu, launch_s),
    }


def phase(step: str) -> str:
    """The phase of the backward a step belongs to: ``torch`` (the factors: torch's passes or the GRU's factor kernel,
    the GRU's gates, the
    faithful path's GEMMs, the sum over the blocks), ``jacobians`` (the faithful fill), ``up`` (the factored up
    kernel), ``scan`` (the factored path's middle phase: its one-launch kernel, or the Blelloch kernels where ``L_m``
    bounds the tree), ``down`` (the factored down and the gradients' reduction)."""
    if step.startswith("torch.") or step == "bppsa_gru_factors":
        return "torch"
    if step.startswith("bppsa_rnn_jacobians"):
        return "jacobians"
    if step.startswith("bppsa_factored_up"):
        return "up"
    if step.startswith("bppsa_factored_down") or step == "bppsa_factored_grads":
        return "down"
    return "scan"


PHASES = ("torch", "jacobians", "up", "scan", "down")


def graphed(layout: str, cell: str, T: int, B: int, H: int, I: int, itemsize: int, gpu: Gpu,
            launch_s: float = LAUNCH_S) -> dict:
    """The backward replayed as one CUDA graph (no host time per launch): ``graph_s``, each phase's device seconds
    (``<phase>_s``, :func:`phase`) and the ``dominant`` phase."""
    per = dict.fromkeys(PHASES, 0.0)
    for s in steps(layout, cell, T, B, H, I, itemsize, gpu):
        per[phase(s.name)] += _device_s(s, H, itemsize, gpu, launch_s)
    return {"graph_s": sum(per.values()), **{f"{k}_s": v for k, v in per.items()},
            "dominant": max(per, key=per.get)}


def _device_s(s: Step, H: int, itemsize: int, gpu: Gpu, launch_s: float, lds_per_fma: float | None = None) -> float:
    """One step's device time: the floor's bound, the shared-load ceiling (at the step's own loads per FMA, or
    ``lds_per_fma`` for every kernel), the latency of its blocks' dependent steps, and the launch overhead per
    kernel."""
    resident = gpu.sms * gpu.threads_per_sm
    fill = _fill(s, gpu)
    bound = max(s.moved * itemsize / (gpu.bandwidth_GBps * 1e9), s.flop / gpu.peak_flops(itemsize))
    lds = s.lds_per_fma if lds_per_fma is None else lds_per_fma
    if (s.serial or s.fma_per_step) and gpu.clock_GHz and gpu.sms:
        smem_Bps = gpu.sms * SMEM_BYTES_PER_CLK * gpu.clock_GHz * 1e9
        bound = max(bound, s.flop / 2 * lds * itemsize / smem_Bps)
    latency = s.seconds
    if s.fma_per_step:
        latency = _issue_latency(s, itemsize, gpu)
    elif s.serial and resident:
        waves = -(-s.threads // resident)
        latency = waves * s.serial * STEP_S[s.step] * H / 20
    return max(bound / fill, latency) + s.kernels * launch_s


def _fill(s: Step, gpu: Gpu) -> float:
    """The fraction of the GPU a launch occupies: its threads over the resident threads, or for the register up kernel
    (a thread does a pair's NC columns, ILP instead of threads) the warp schedulers its warps reach."""
    if s.threads == 0 or gpu.sms == 0:
        return 1.0
    if s.seconds and s.block:  # the middle kernel: its latency term streams the loads; a block per SM it reaches
        return min(1.0, s.threads // s.block / gpu.sms)
    if s.fma_per_step and s.block:
        blocks = s.threads // s.block
        warps_per_sm = -(-blocks // gpu.sms) * s.block / 32
        return min(blocks, gpu.sms) * min(SCHEDULERS_PER_SM, warps_per_sm) / (gpu.sms * SCHEDULERS_PER_SM)
    return min(1.0, s.threads / (gpu.sms * gpu.threads_per_sm))


def _issue_latency(s: Step, itemsize: int, gpu: Gpu) -> float:
    """The register up kernel's chain: a warp issues its ``fma_per_step`` multiply-adds per step at
    ISSUE_PER_FMA instructions each (or at its dtype's pipe rate where that is slower: fp64 on most parts), one
    instruction a clock per scheduler, and the warps an SM holds share its SCHEDULERS_PER_SM schedulers whether
    they are resident together or in waves.  Assumed: enough independent multiply-adds in a step (the NC·H
    accumulators) to issue every clock, and the factor loads' latency hidden (unknown at 10 warps per SM).
    0 for a GPU of unknown clock."""
    if not (gpu.clock_GHz and gpu.sms and s.block):
        return 0.0
    clock = gpu.clock_GHz * 1e9
    lanes = gpu.peak_flops(itemsize) / 2 / clock / (gpu.sms * SCHEDULERS_PER_SM)  # FMA lanes per scheduler
    clocks_per_fma = max(ISSUE_PER_FMA, 32 / lanes)
    blocks_per_sm = -(-(s.threads // s.block) // gpu.sms)
    share = max(1.0, blocks_per_sm * s.block / 32 / SCHEDULERS_PER_SM)
    return s.serial * s.fma_per_step * clocks_per_fma * share / clock


def _middle_clocks(K: int, H: int, itemsize: int, warps: int, gpu: Gpu) -> float:
    """Clocks of the one-launch middle phase's chain (``factored_warp.cu``) over K chunks with ``warps`` warps, from
    its code, not timed (assumptions, module constants):

    * a walked transition (a mat-vec): H shuffles issued and H dependent multiply-adds (FMA_DEP_CLK each), plus the
      staging (2·ceil(H²/32) loads and stores a lane, STAGE_CLK); but no less than a global load's latency
      (GLOBAL_LATENCY_S) over the D aggregates streamed ahead (:func:`.plan.middle_depth`);
    * a composed transition: H² multiply-adds a lane at the dtype's pipe rate and H²·itemsize/16 shared loads,
      plus the staging, with the same floor;
    * a map applied (warp 0, phase 2): a mat-vec from shared memory;
    * two block barriers (100 clocks) where there is more than one warp.
    Segments (:func:`.plan.middle_segments`): L transitions walked by warp 0 while warps 1 .. Wn - 2 compose theirs,
    Wn - 2 maps applied, then L transitions walked by each later warp at once."""
    if K < 2:
        return 0.0
    clock = gpu.clock_GHz * 1e9
    lanes = gpu.peak_flops(itemsize) / 2 / clock / (gpu.sms * SCHEDULERS_PER_SM)
    pipe = max(1.0, 32 / lanes)  # issue clocks of one warp multiply-add
    ns = -(-H * H // 32) if H <= 32 else 0
    floor = GLOBAL_LATENCY_S * clock / plan.middle_depth(H, itemsize)
    dep = FMA_DEP_CLK[itemsize]
    mv = H * (1 + dep) + (2 * ns + STAGE_CLK if ns else 0)
    walk = max(mv, floor if ns else GLOBAL_LATENCY_S * clock)
    mm = H * H * pipe + H * H * itemsize / LDS_BYTES + 2 * ns + STAGE_CLK
    L, Wn = plan.middle_segments(K, warps)
    if Wn == 1:
        return L * walk
    first = max(walk, max(mm, floor) if Wn > 2 else 0.0)
    return L * first + (Wn - 2) * H * (1 + dep) + L * walk + 100


SHFL_CLK = 30  # a shuffle's latency (clocks), assumed
GRU_FACTOR_KERNEL = True  # the GRU's factors by bppsa_gru_factors (False: torch's passes, as the first GPU runs did)
GRADS_IN_FLIGHT = 4  # iterations of the gradients' reduction whose loads a warp keeps in flight, assumed


def _down_warp_seconds(launch: plan.Launch, itemsize: int, gpu: Gpu) -> float:
    """The warp down kernel's time from its code (assumptions, not fits; no GPU has run it).  A warp walks its chunk's
    C steps; a step's dependent chain is a mat-vec (shuffles, then H dependent multiply-adds, SHFL_CLK + H·FMA_DEP_CLK
    + STAGE_CLK) but at least a global load's latency (its factors are loaded one step ahead).  A step issues, per warp,
    NW·H shuffles and multiply-adds for the mat-vec and, with the sums, NBV shuffles and the rows' multiply-adds (rnn
    NBV, gru 3·NBV + 1), and its loads; an SM's warps share SCHEDULERS_PER_SM schedulers.  The time is the longer of a
    warp's chain over its C steps and the busiest scheduler's issue over the whole launch."""
    if not (gpu.clock_GHz and gpu.sms):
        return 0.0
    n, B, H, I, C, mode = (launch.ints[i] for i in (0, 1, 2, 3, 4, 7))
    kind = launch.kernel.rsplit("_", 1)[1]
    clock = gpu.clock_GHz * 1e9
    nw = 1 if kind == "rnn" else 3
    nbv = I + 1 + H
    lanes = gpu.peak_flops(itemsize) / 2 / clock / (gpu.sms * SCHEDULERS_PER_SM)
    pipe = max(1.0, 32 / lanes)
    chain = max(SHFL_CLK + H * FMA_DEP_CLK[itemsize] + STAGE_CLK, GLOBAL_LATENCY_S * clock)
    issue = nw * H * (1 + pipe) + (1 if kind == "rnn" else 5) + -(-nbv // 32) + 8
    if mode & 1:
        issue += nbv + (nbv if kind == "rnn" else 3 * nbv + 1) * pipe
    K = -(-n // C)
    pairs = K * B
    per_sched = -(-pairs // gpu.sms) / SCHEDULERS_PER_SM
    return max(min(C, n) * chain, n / K * issue * max(1.0, per_sched)) / clock


def middle_warps(K: int, H: int, itemsize: int = 4, gpu: Gpu | None = None) -> int:
    """The middle phase's warps for K chunks: the fewest of least :func:`_middle_clocks` (1 .. the plan's maximum)."""
    gpu = GPUS[CHUNK_GPU] if gpu is None else gpu
    if K < 3 or not gpu.clock_GHz:
        return 1
    top = min(plan.middle_max_warps(H, itemsize), K - 1)
    return min(range(1, top + 1), key=lambda w: (_middle_clocks(K, H, itemsize, w, gpu), w))


def expected(layout: str, cell: str, T: int, B: int, H: int, I: int, itemsize: int, gpu: Gpu,
             launch_s: float = LAUNCH_S, lds_per_fma: float | None = None, host: bool = True) -> dict:
    """The expected time of one backward (module docstring): ``host_s`` (the host's time to issue it),
    ``device_s`` (the sum of the steps' device times) and ``expected_s``, the device's finish when each step
    starts once the host has issued it and the previous step is done.  ``host=False``: no host time per launch
    (a backward replayed as one CUDA graph).  ``lds_per_fma``: one figure for every kernel instead of each
    kernel's own."""
    st = steps(layout, cell, T, B, H, I, itemsize, gpu)
    t_host = (HOST_FIXED_S + GLUE_TORCH_OPS[(layout, cell)] * HOST_TORCH_S) if host else 0.0
    t_dev = 0.0
    device = 0.0
    for s in st:
        if host:
            t_host += s.kernels * (HOST_TORCH_S if s.threads == 0 else HOST_LAUNCH_S)
        d = _device_s(s, H, itemsize, gpu, launch_s, lds_per_fma)
        device += d
        t_dev = max(t_dev, t_host) + d
    return {"host_s": t_host, "device_s": device, "expected_s": max(t_dev, t_host)}


# -- the chunk size: the model that predicts also chooses ----------------------------------------------------------
CHUNK_GPU = "h100"  # the machine chunk_size plans for where none is named


def chunk_cost(kind: str, n: int, B: int, H: int, I: int, C: int, itemsize: int = 4, gpu: Gpu | None = None) -> float:
    """Expected device seconds of the factored kernels with chunks of ``C`` steps (:func:`_device_s` of each launch of
    :func:`.plan.factored_plan`, as a replayed graph runs them: no host time; torch's factor passes, which C does
    not change, left out).  Large C lengthens the up and down chains, small C the middle scan."""
    gpu = GPUS[CHUNK_GPU] if gpu is None else gpu
    warps = middle_warps(-(-n // C), H, itemsize, gpu)
    launches = plan.factored_plan(kind, n, B, H, I, C, itemsize=itemsize, warps=warps)[1]
    return sum(_device_s(Step.of(x, itemsize, gpu), H, itemsize, gpu, LAUNCH_S) for x in launches)


@functools.lru_cache(maxsize=1024)
def chunk_size(kind: str, n: int, B: int, H: int, I: int = 1, itemsize: int = 4, gpu: Gpu | None = None) -> int:
    """The factored plan's default chunk: among :func:`.plan.chunk_candidates` (powers of two leaving at least 8
    chunks), the one of least :func:`chunk_cost` (the larger on a tie)."""
    return min(plan.chunk_candidates(n), key=lambda C: (chunk_cost(kind, n, B, H, I, C, itemsize, gpu), -C))


def factored_plan(kind: str, n: int, B: int, H: int, I: int, C: int | None = None, *, gpu: Gpu | None = None,
                  **kw) -> tuple[int, tuple[plan.Launch, ...]]:
    """:func:`.plan.factored_plan` with C = :func:`chunk_size`'s where ``C`` is None, and the middle phase's warps
    :func:`middle_warps`'s where ``warps`` is None or not given (what the backend runs)."""
    if C is None:
        C = chunk_size(kind, n, B, H, I, kw.get("itemsize", 4), gpu)
    if kw.get("warps") is None:
        kw["warps"] = middle_warps(-(-n // C), H, kw.get("itemsize", 4), gpu)
    return plan.factored_plan(kind, n, B, H, I, C, **kw)
