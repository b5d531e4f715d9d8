"""The computed rows of an attribution graph, held sparsely.

A row (of a logit or an explored feature) has a column per source node and is zero for later
layers and positions, so only nonzero entries are kept, in blocks as computed: ``counts``
``[b]``, ``columns`` ``[nnz]`` int32, ``values`` ``[nnz]``, and per row its ``nodes``,
``constants``, ``targets`` (so closure stays a check) and ``magnitudes`` (its rounding's scale,
:mod:`.edges`; 0 where not measured). Readers iterate :meth:`RowStore.chunks`; per-row sums are
memoised until the next :meth:`RowStore.append`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..errors import InputError

#: Entries per chunk handed to readers: bounds their transient memory (4 M entries).
CHUNK_ENTRIES = 1 << 22
#: A :class:`RowBlock`'s arrays, as :meth:`RowStore.state` writes them (``rows.<name>``).
ARRAYS = ("nodes", "counts", "columns", "values", "constants", "targets", "magnitudes")


@dataclass
class RowBlock:
    """Rows appended together: nodes, nonzero entries (CSR without the leading zero) and the
    per-row scalars."""

    nodes: torch.Tensor
    counts: torch.Tensor
    columns: torch.Tensor
    values: torch.Tensor
    constants: torch.Tensor
    targets: torch.Tensor
    magnitudes: torch.Tensor

    @property
    def nnz(self) -> int:
        return int(self.values.numel())


@dataclass
class RowStore:
    """Sparse rows over ``n_columns`` source nodes (module docstring)."""

    n_columns: int
    blocks: list[RowBlock] = field(default_factory=list)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __repr__(self) -> str:
        return (f"RowStore({self.n_rows:,} rows x {self.n_columns:,} columns, {self.nnz:,} "
                f"entries, {self.nbytes / 2**20:,.1f} MB)")

    # ----------------------------------------------------------------------- writing
    def append(self, nodes: torch.Tensor, rows: torch.Tensor, constants: torch.Tensor,
               targets: torch.Tensor, magnitudes: torch.Tensor | None = None) -> None:
        """Add dense ``rows`` ``[b, n_columns]`` of ``nodes`` (zeros are dropped; the entries
        are found on the rows' device, then kept on the CPU); ``magnitudes`` (module docstring)
        default to 0."""
        rows = rows.detach()
        if rows.dim() != 2 or rows.shape[1] != self.n_columns:
            raise InputError(f"rows must be [b, {self.n_columns}], got {tuple(rows.shape)}")
        mask = rows != 0
        row_index, columns = mask.nonzero(as_tuple=True)
        self.blocks.append(RowBlock(
            nodes=torch.as_tensor(nodes).cpu().long().reshape(-1),
            counts=mask.sum(1).long().cpu(),
            columns=columns.int().cpu(),
            values=rows[row_index, columns].cpu(),
            constants=torch.as_tensor(constants).detach().cpu().double().reshape(-1),
            targets=torch.as_tensor(targets).detach().cpu().double().reshape(-1),
            magnitudes=(torch.zeros(len(rows), dtype=torch.float64) if magnitudes is None else
                        torch.as_tensor(magnitudes).detach().cpu().double().reshape(-1))))
        self._cache.clear()

    # ----------------------------------------------------------------------- reading
    @property
    def n_rows(self) -> int:
        return sum(len(b.nodes) for b in self.blocks)

    @property
    def nnz(self) -> int:
        return sum(b.nnz for b in self.blocks)

    @property
    def nbytes(self) -> int:
        per_row = 5 * 8  # node, count, constant, target, magnitude
        return sum(b.values.numel() * b.values.element_size() + 4 * b.nnz
                   + per_row * len(b.nodes) for b in self.blocks)

    def _cat(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            parts = [getattr(b, name) for b in self.blocks]
            self._cache[name] = torch.cat(parts) if parts else torch.zeros(0)
        return self._cache[name]

    @property
    def nodes(self) -> torch.Tensor:
        """Each row's node, in row order ``[R]``."""
        return self._cat("nodes").long()

    @property
    def constants(self) -> torch.Tensor:
        return self._cat("constants")

    @property
    def targets(self) -> torch.Tensor:
        return self._cat("targets")

    @property
    def magnitudes(self) -> torch.Tensor:
        return self._cat("magnitudes")

    def row_of_node(self, n_nodes: int) -> torch.Tensor:
        """``[n_nodes]``: each node's row index, -1 for nodes without a row."""
        key = ("row_of_node", n_nodes)
        if key not in self._cache:
            out = torch.full((n_nodes,), -1, dtype=torch.long)
            out[self.nodes] = torch.arange(self.n_rows)
            self._cache[key] = out
        return self._cache[key]

    def chunks(self, max_entries: int = CHUNK_ENTRIES
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(row, column, value)`` per entry, row-aligned chunks of at most ``max_entries``
        entries (one row may exceed it alone); ``row`` is the global row index (int64)."""
        first = 0
        for block in self.blocks:
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), block.counts.cumsum(0)])
            start_row, n = 0, len(block.counts)
            while start_row < n:
                limit = int(offsets[start_row]) + max_entries
                end_row = int(torch.searchsorted(offsets, limit, right=True)) - 1
                end_row = min(n, max(end_row, start_row + 1))
                lo, hi = int(offsets[start_row]), int(offsets[end_row])
                rows = torch.repeat_interleave(
                    torch.arange(first + start_row, first + end_row),
                    block.counts[start_row:end_row])
                yield rows, block.columns[lo:hi].long(), block.values[lo:hi]
                start_row = end_row
            first += n

    def abs_sums(self) -> torch.Tensor:
        """``sum_c |A[r, c]|`` per row (float64), memoised."""
        if "abs_sums" not in self._cache:
            out = torch.zeros(self.n_rows, dtype=torch.float64)
            for rows, _, values in self.chunks():
                out.index_add_(0, rows, values.abs().double())
            self._cache["abs_sums"] = out
        return self._cache["abs_sums"]

    def sums(self) -> torch.Tensor:
        """``sum_c A[r, c]`` per row (float64)."""
        out = torch.zeros(self.n_rows, dtype=torch.float64)
        for rows, _, values in self.chunks():
            out.index_add_(0, rows, values.double())
        return out

    def dense(self, rows: torch.Tensor | list[int]) -> torch.Tensor:
        """Dense ``[len(rows), n_columns]`` copies of the given rows (row indices)."""
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        dtype = self.blocks[0].values.dtype if self.blocks else torch.float32
        out = torch.zeros(len(rows), self.n_columns, dtype=dtype)
        where = torch.full((self.n_rows,), -1, dtype=torch.long)
        where[rows] = torch.arange(len(rows))
        for r, cols, values in self.chunks():
            slot = where[r]
            keep = slot >= 0
            out[slot[keep], cols[keep]] = values[keep]
        return out

    # ----------------------------------------------------------------- safetensors
    def state(self) -> dict[str, torch.Tensor]:
        """Flat tensors for safetensors (blocks concatenated)."""
        return {f"rows.{name}": torch.cat([getattr(b, name) for b in self.blocks]).contiguous()
                if self.blocks else torch.zeros(0) for name in ARRAYS}

    @classmethod
    def from_state(cls, n_columns: int, tensors: dict[str, torch.Tensor],
                   n_logits: int = 1) -> RowStore:
        """Inverse of :meth:`state`, refusing (:class:`InputError`, saying what) arrays that
        cannot be rows of a graph of ``n_columns`` source and ``n_logits`` logit nodes: missing, of
        the wrong kind or length, inconsistent counts, nodes or columns out of range or repeated,
        non-finite values. A file written before ``magnitudes`` were kept reads them as 0."""
        missing = [f"rows.{name}" for name in ARRAYS[:-1] if f"rows.{name}" not in tensors]
        if missing:
            raise InputError(f"no row arrays {', '.join(missing)}")
        t = {name: tensors[f"rows.{name}"] for name in ARRAYS[:-1]}
        t["magnitudes"] = tensors.get("rows.magnitudes",
                                      torch.zeros(len(t["nodes"]), dtype=torch.float64))
        if any(t[name].dim() != 1 for name in ARRAYS):
            raise InputError("row arrays that are not one-dimensional")
        integral = ("nodes", "counts", "columns")
        if any(t[name].numel() and (t[name].is_floating_point() or t[name].is_complex()
                                    or t[name].dtype == torch.bool) for name in integral) \
                or any(t[name].numel() and not t[name].is_floating_point()
                       for name in ("values", "constants", "targets", "magnitudes")):
            raise InputError("row arrays of the wrong dtype")
        n = len(t["nodes"])
        if not (len(t["counts"]) == len(t["constants"]) == len(t["targets"])
                == len(t["magnitudes"]) == n):
            raise InputError("row arrays of different lengths")
        if n and int(t["counts"].min()) < 0:
            raise InputError("a negative row entry count")
        if int(t["counts"].sum()) != len(t["values"]) or len(t["columns"]) != len(t["values"]):
            raise InputError("row entry counts do not match the stored entries")
        if len(t["columns"]) and not (0 <= int(t["columns"].min())
                                      and int(t["columns"].max()) < n_columns):
            raise InputError("a stored column is outside the graph")
        if n and not (0 <= int(t["nodes"].min())
                      and int(t["nodes"].max()) < n_columns + n_logits):
            raise InputError("a row's node is outside the graph")
        if len(torch.unique(t["nodes"])) != n:
            raise InputError("a node's row is stored twice")
        if not all(bool(torch.isfinite(t[name]).all())
                   for name in ("values", "constants", "targets", "magnitudes")):
            raise InputError("a stored row value is not finite")
        if n and float(t["magnitudes"].min()) < 0:
            raise InputError("a negative row magnitude")
        store = cls(n_columns)
        if n:
            store.blocks.append(RowBlock(t["nodes"].long(), t["counts"].long(),
                                         t["columns"].int(), t["values"],
                                         t["constants"].double(), t["targets"].double(),
                                         t["magnitudes"].double()))
        return store
