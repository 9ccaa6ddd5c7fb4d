"""The GPU memory one job of the workflow needs, term by term, from how the CUDA path allocates.

``bppsa paper-shapes`` (:mod:`bppsa.bench.preflight`) prints it for the paper profile's extreme shapes, so a
GPU user sees what fits a 16 or 80 GB card before a job meets it; ``tests/test_paper_shapes.py`` holds every
term to the bytes of the tensors the code really allocates at a small shape.  The time on the GPU is
:mod:`.cost_model`'s.
"""
from __future__ import annotations

import math

GB = 10**9
CAPACITIES_GB = (16, 80)  # the GPU sizes the table flags; decimal GB, i.e. below the cards' 16/80 GiB
INDEX_BYTES = 8  # int64: class labels, max-pool indices


def recurrent_param_count(model: str, H: int, I: int, C: int) -> int:
    """Parameters of the RNN (one gate) or GRU (three gates) cell plus the linear head."""
    gates = {"rnn": 1, "gru": 3}[model]
    return gates * (H * I + H * H + 2 * H) + C * H + C


def recurrent_gpu_bytes(model: str, T: int, B: int, H: int, I: int, C: int, layout: str, itemsize: int,
                        L_m: int | None = None) -> dict[str, dict[str, int]]:
    """The GPU memory of one training step, term by term (bytes), for the BPPSA step on the CUDA path
    (backend ``cupy``) and for the autograd/cuDNN baseline.  Returns ``{"bppsa": {...}, "baseline": {...}}``.

    BPPSA (``RecurrentClassifier.bppsa_step`` with ``CupyBackend``):

    * parameters, their gradients and Adam's two moments: 4·P·s;
    * inputs ``x`` T·B·I·s and labels B·8; hidden states ``h`` T·B·H·s (the cell's no-grad forward);
    * Jacobians: n·B·H²·s with n = 2T (layout ``paper``) or T (``fused``, and the GRU)
      (``CupyBackend.rnn_jacobians_t``'s ``out``; the GRU's ``gru_jacobians_t`` buffer);
    * the GRU's recomputed gates, kept for the gates' gradients: 7·T·B·H·s (``gh`` [3H], ``r, z`` [2H],
      ``n``, ``h'``; ``gru_gates``);
    * scan workspace: ``S`` (L+1)·B·H·s and the prefixes ``P`` n·B·H·s (``CupyBackend.scan``; the scan
      overwrites J in place);
    * per-step gradients from the prefixes: T·B·H·s (RNN ∇a_t) or 4·T·B·H·s (GRU dR, dZ, dN, dM).

    Not itemised: elementwise temporaries of at most T·B·H·s each while these are built, the CUDA context,
    cuDNN's forward workspace and the caching allocator's rounding.

    Baseline (autograd over cuDNN): the same parameters, optimizer state and inputs; the output sequence
    T·B·H·s and its zero gradient T·B·H·s; the input gradient T·B·I·s; and a *modelled* cuDNN reserve of
    G·T·B·H·s with G the per-step activations a backward needs (tanh: 1; GRU: r, z, n, W_hn h' + b_hn: 4).
    cuDNN's real reserve size is implementation-defined (``cudnnGetRNNTempSpaceSizes``); this is a model.
    """
    from ...jacobians.recurrent import num_jacobians
    from ...scan import tree_levels

    s = itemsize
    P = recurrent_param_count(model, H, I, C)
    n = num_jacobians(T, layout) if model == "rnn" else T
    TBH = T * B * H * s
    common = {"parameters": P * s, "gradients": P * s, "optimizer": 2 * P * s,
              "inputs": T * B * I * s + B * INDEX_BYTES}
    bppsa = dict(common, hidden_states=TBH, jacobians=n * B * H * H * s,
                 gates=7 * TBH if model == "gru" else 0,
                 scan_workspace=(tree_levels(n + 1, L_m) + 1) * B * H * s + n * B * H * s,
                 step_grads=(4 if model == "gru" else 1) * TBH)
    baseline = dict(common, output=TBH, output_grad=TBH, input_grad=T * B * I * s,
                    reserve_model=(4 if model == "gru" else 1) * TBH)
    return {"bppsa": bppsa, "baseline": baseline}


def vgg_gpu_bytes(params: int, shapes: list[tuple[str, tuple]], B: int, itemsize: int, classes: int = 10,
                  image_size: int = 32) -> dict[str, int]:
    """GPU memory of one VGG-11 training step (SGD with momentum, as ``vgg.train``), term by term (bytes), from
    its parameter count and its conv part's layers (``bppsa.models.vgg.feature_shapes``).

    * parameters, gradients, momentum: 3·P·s;
    * the input batch B·3·32·32·s and labels B·8;
    * what autograd saves for the backward besides the batch and the weights (one copy per storage): every
      ReLU's output (a conv's or a pool's input where they follow), every max-pool's output (the next conv's,
      or the linear layer's, input) and its int64 indices, the logits' log-softmax B·C·s and the loss's
      total weight (one scalar);
    * backward transients: the gradient of the largest activation, twice (incoming and outgoing).

    Not itemised: cuDNN's convolution workspace (algorithm-dependent), the CUDA context.
    """
    s, P = itemsize, params
    saved = sum(math.prod(shp) for kind, shp in shapes if kind in ("relu", "pool")) * B * s
    pool_idx = sum(math.prod(shp) for kind, shp in shapes if kind == "pool") * B * INDEX_BYTES
    largest = max(math.prod(shp) for _, shp in shapes) * B * s
    x = B * 3 * image_size * image_size * s
    return {"parameters": P * s, "gradients": P * s, "optimizer": P * s, "inputs": x + B * INDEX_BYTES,
            "saved_activations": saved + pool_idx + B * classes * s + s, "backward_transients": 2 * largest}


def fits(total_bytes: float, capacity_gb: float) -> bool:
    return total_bytes <= capacity_gb * GB
