"""How many row groups the two-stage dbias reduction uses: a shape-only policy.

The dact + dbias kernels write one float32 partial sum per (row group, column) to a workspace
``[batches, groups, N]`` and then sum the groups in a fixed order. The group count is a function
of the shape and dtype only, never of the device, so dbias has the same bits everywhere; on the
CPU the groups are the thread-pool tasks.

The numbers are tuned for the CUDA kernels (ffi/activation/cuda/NOTES.md has the timings behind
them): they run one block per (column tile of 32 16-byte vectors, batch, group), and
more, shorter groups fill the last wave better at the cost of a larger workspace for the
finalize to read. Changing them changes the CUDA kernels' speed (and the summation order, so
dbias's last bits), not what is computed.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["DbiasGroupPolicy", "UNQUANTIZED", "QUANTIZED"]


@dataclasses.dataclass(frozen=True)
class DbiasGroupPolicy:
    """Row groups per batch: about ``target_blocks / column tiles``, at least
    ``min_rows_per_group`` rows each, at most ``max_groups``.

    Attributes:
      target_blocks: CUDA blocks aimed at over the whole grid.
      max_groups: cap on the groups per batch (bounds the workspace and the finalize).
      min_rows_per_group: keeps the float32 workspace under ~3% of the data it sums.
    """

    target_blocks: int
    max_groups: int
    min_rows_per_group: int = 64

    def groups(self, rows_per_batch: int, hidden: int, itemsize: int) -> int:
        """The group count for ``rows_per_batch`` rows of ``hidden`` columns of ``itemsize``
        bytes (``hidden`` is the last axis; a column tile is 32 vectors of 16 bytes)."""
        col_tiles = max(1, math.ceil(hidden / (32 * (16 // itemsize))))
        want = math.ceil(self.target_blocks / col_tiles)
        return max(
            1, min(self.max_groups, want, math.ceil(rows_per_batch / self.min_rows_per_group))
        )


# The unquantized kernel (dact_dbias.cu): ~32768 blocks of >= 64-row groups.
UNQUANTIZED = DbiasGroupPolicy(target_blocks=32768, max_groups=2048)
# The quantized tile kernels (quantize.cuh): ~8192 blocks.
QUANTIZED = DbiasGroupPolicy(target_blocks=8192, max_groups=512)
