"""The CUDA-graph batch-size ladder: which decode batch sizes get a graph, and the size a batch pads to.

Below the runtime because kernels that choose tiles or splits by batch size (the Triton decode
attention) choose them for the padded size, so an eager step sums exactly like a graph replay.
"""
from __future__ import annotations



def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, then steps of 16 up to 64, of 32 up to 256, of 64 beyond (and max_bs).

    Decode is bandwidth-bound, so padding a batch by up to ~25 % costs little; fewer graphs make
    start-up faster (each capture runs the model three times).
    """
    sizes = [b for b in _candidates(max_bs) if b <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(set(sizes))


def _candidates(upto: int) -> list[int]:
    return [1, 2, 4, 8, 16, 24, 32, 48, 64] + list(range(96, 257, 32)) + list(range(320, upto + 1, 64))


def padded_batch_size(bs: int) -> int:
    """The graph batch size a decode batch of ``bs`` seqs pads to with the default sizes (kernels that
    choose tiles or splits by batch size choose them for this size, so an eager step sums exactly
    like a graph replay; a ``cuda_graph_max_bs`` off the list adds one size the rule does not know)."""
    for b in _candidates(bs + 64):
        if b >= bs:
            return b
    return bs
