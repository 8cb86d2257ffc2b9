"""STEM tables during training: kept off the accelerator, trained one step's rows at a time.

Which rows a step needs is known from its token ids before the forward. So a table stays where it
was loaded (CPU memory), and each step gathers the rows of its distinct ids into a small leaf
tensor on the compute device (`rows`). Forward looks rows up there; after backward the optimizer
updates exactly those rows and writes them back. Neither the table's gradient nor its optimizer
state is ever the size of the table:

- `rowwise_adagrad` keeps one float per row, the running sum of the row's mean squared gradient
  (the standard optimizer of huge recommendation tables);
- `adam` is Adam with full first and second moments, updated lazily on the touched rows (torch's
  SparseAdam semantics); its state is twice the table, kept for comparison;
- `adamw` is plain dense AdamW: every row is gathered and updated every step (gradients, state and
  update all of table size), the baseline the row-wise optimizers are measured against.

One host copy per machine (`SharedTables`): the tables and their optimizer states are files mapped
by every process of the machine, and each row is updated by one process only.
"""

import itertools
import math
from pathlib import Path

import torch

from ..errors import UserError
from ..mapped import NoSpace, map_file, reserve

ROWS_PER_COPY = 4096  # rows copied at once when a shared table is filled


class SharedTables:
    """The tables being trained and their optimizer states, one copy per machine for all its processes.

    Each tensor is a file in `folder`, mapped with MAP_SHARED (`torch.from_file(shared=True)`) by
    every process of the machine: the kernel holds one copy in its page cache, however many
    processes map it (proportional set size counts it once). Every process gathers the rows it
    needs; row v is written by local process v % local_world alone, each row update applied once.
    The local main process creates and fills the files; `wait` is a barrier across processes.
    Put `folder` on a RAM file system (/dev/shm) to keep it off the disk; on several machines it
    must be a folder of each machine's own (each machine's processes update their own copy).
    """

    def __init__(self, folder: Path, local_rank: int, local_world: int, wait=lambda: None):
        self.folder, self.local_rank, self.local_world, self.wait = Path(folder), local_rank, local_world, wait
        if local_rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.wait()

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, fill=None) -> torch.Tensor:
        """A shared tensor of zeros, or filled by `fill(start, stop) -> rows [start, stop)` (a table)."""
        path = self.folder / f"{name}.bin"
        numel = math.prod(shape)
        if self.local_rank == 0:
            with path.open("wb") as f:
                try:
                    reserve(f, numel * dtype.itemsize)
                except NoSpace:
                    raise UserError(f"no space for the tables' host copy in {self.folder}: {path.name} needs "
                                    f"{numel * dtype.itemsize / 2**30:.2f} GiB; free space there or set "
                                    f"tables.host_dir to a folder with room (/dev/shm keeps it in RAM)") from None
            if fill is not None:
                mapped = map_file(path, shape, dtype)
                for start in range(0, shape[0], ROWS_PER_COPY):
                    stop = min(start + ROWS_PER_COPY, shape[0])
                    mapped[start:stop] = fill(start, stop)
                del mapped
        self.wait()
        return map_file(path, shape, dtype)

    def zeros(self, name: str):
        """A `zeros(shape, dtype)` factory of shared tensors named NAME.0, NAME.1, ... for an optimizer's state."""
        count = itertools.count()
        return lambda shape, dtype=torch.float32: self.tensor(f"{name}.{next(count)}", tuple(shape), dtype)

    def memory(self) -> list[float]:
        """GiB of this process's [proportional set size, PSS of the shared files, RSS of the shared files],
        from /proc/self/smaps (Linux; zeros elsewhere). PSS divides each page among the processes mapping it."""
        sizes, in_shared, prefix = [0, 0, 0], False, str(self.folder.resolve())
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    key, _, rest = line.partition(" ")
                    if not key.endswith(":"):  # a mapping's header: address range, permissions, ..., path
                        in_shared = line.rstrip().split(maxsplit=5)[-1].startswith(prefix)
                    elif key in ("Pss:", "Rss:"):
                        kb = int(rest.split()[0])
                        if key == "Pss:":
                            sizes[0] += kb
                        if in_shared:
                            sizes[1 if key == "Pss:" else 2] += kb
        except OSError:
            pass
        return [kb / 2**20 for kb in sizes]

def distinct_ids(ids: torch.Tensor) -> torch.Tensor:
    """The sorted distinct ids of a batch (any shape) in host memory, which `OffloadedTable.gather` takes:
    computed once per batch for every table, where the batch still is on the host (no device sync)."""
    return ids.unique().cpu()  # .cpu() of a host tensor is the tensor itself


class OffloadedTable:
    """A [vocab, k] table in host memory plus the rows the current step uses, on the device."""

    def __init__(self, weight: torch.Tensor, device: torch.device, owner: tuple[int, int] = (0, 1)):
        self.weight = weight  # [vocab, k], storage dtype, host memory (maybe shared by processes)
        self.device = device
        self.owner = owner  # (local rank, local world): this process writes the rows v with v % world == rank
        self.ids = None  # [n] sorted distinct ids of the step, on the device
        self.rows = None  # [n, k] fp32 leaf on the device

    def gather(self, unique: torch.Tensor) -> None:
        """Make the rows of `unique` (sorted distinct ids in host memory, `distinct_ids`) the trainable rows of
        this step."""
        self.ids = unique.to(self.device)
        self.rows = self.weight[unique].to(self.device, torch.float32).requires_grad_()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """[..., k] rows for `ids`; every id must be among those of the last `gather`."""
        return self.rows[torch.searchsorted(self.ids, ids.contiguous())]

    def __call__(self, forward, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The rows of a forward's ids, as a STEM MLP's `up_table` is called."""
        return self.lookup(forward.on(self.device)).to(device, dtype)  # [batch, seq, k]

    def owned(self) -> torch.Tensor:
        """[k] positions in `ids` of the rows this process updates."""
        rank, world = self.owner
        return torch.arange(self.ids.numel(), device=self.ids.device) if world == 1 else (self.ids % world == rank).nonzero()[:, 0]

    def write_back(self, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Store updated `rows` [m, k] of the ids at `positions` [m]."""
        self.weight[self.ids[positions].cpu()] = rows.to("cpu", self.weight.dtype)


class RowwiseAdagrad:
    """Adagrad with one accumulator per row: G[v] += mean(g_v^2); row -= lr * g_v / (sqrt(G[v]) + eps)."""

    def __init__(self, tables: list[OffloadedTable], eps: float = 1e-8, weight_decay: float = 0.0, zeros=torch.zeros):
        """`zeros(shape, dtype)` allocates the state (`SharedTables.zeros`: one copy per machine)."""
        self.tables, self.eps, self.weight_decay = tables, eps, weight_decay
        self.state = [zeros((t.weight.shape[0],), dtype=torch.float32) for t in tables]  # [vocab] per table

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for table, accum in zip(self.tables, self.state):
            mine = table.owned()  # the rows of the step that this process updates
            ids = table.ids[mine].cpu()
            grad = table.rows.grad[mine]  # [m, k]
            accum[ids] += grad.square().mean(1).cpu()
            denom = accum[ids].to(grad.device).sqrt().add_(self.eps)[:, None]
            rows = table.rows.detach()[mine]
            if self.weight_decay:
                rows.mul_(1 - lr * self.weight_decay)
            table.write_back(mine, rows.addcdiv_(grad, denom, value=-lr))

    def state_dict(self) -> dict:
        return {f"accum.{i}": s for i, s in enumerate(self.state)}

    def load_state_dict(self, state: dict) -> None:
        for i, s in enumerate(self.state):  # in place: the state may be shared with other processes
            s.copy_(state[f"accum.{i}"])


class LazyAdam:
    """Adam (decoupled weight decay) applied to the touched rows only, with per-row step counts."""

    def __init__(self, tables: list[OffloadedTable], eps: float = 1e-8, weight_decay: float = 0.0, zeros=torch.zeros,
                 betas: tuple[float, float] = (0.9, 0.999)):
        self.tables, self.eps, self.weight_decay, self.betas = tables, eps, weight_decay, betas
        self.state = [{"m": zeros(t.weight.shape, dtype=torch.float32), "v": zeros(t.weight.shape, dtype=torch.float32),
                       "t": zeros((t.weight.shape[0],), dtype=torch.int64)} for t in tables]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        b1, b2 = self.betas
        for table, s in zip(self.tables, self.state):
            mine = table.owned()  # the rows of the step that this process updates
            ids = table.ids[mine].cpu()
            grad = table.rows.grad[mine].cpu()
            s["t"][ids] += 1
            t = s["t"][ids].double()[:, None]
            m = s["m"][ids].mul_(b1).add_(grad, alpha=1 - b1)
            v = s["v"][ids].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            s["m"][ids], s["v"][ids] = m, v
            update = (m / (1 - b1**t).float()) / ((v / (1 - b2**t).float()).sqrt() + self.eps)
            rows = table.rows.detach()[mine]
            if self.weight_decay:
                rows.mul_(1 - lr * self.weight_decay)
            table.write_back(mine, rows.sub_(lr * update.to(rows.device)))

    def state_dict(self) -> dict:
        return {f"{k}.{i}": v for i, s in enumerate(self.state) for k, v in s.items()}

    def load_state_dict(self, state: dict) -> None:
        for i, s in enumerate(self.state):  # in place: the state may be shared with other processes
            for k, v in s.items():
                v.copy_(state[f"{k}.{i}"])


class DenseAdamW(LazyAdam):
    """AdamW on whole tables: with every row gathered each step, lazy Adam is exactly AdamW."""

    all_rows = True


TABLE_OPTIMIZERS = {"rowwise_adagrad": RowwiseAdagrad, "adam": LazyAdam, "adamw": DenseAdamW}


def clip_rows(tables: list[OffloadedTable], max_norm: float) -> float:
    """Clip the step's table gradients to a joint L2 norm; returns the norm before clipping."""
    norm = math.sqrt(sum(float(t.rows.grad.float().square().sum()) for t in tables))
    if max_norm and norm > max_norm:
        for t in tables:
            t.rows.grad.mul_(max_norm / (norm + 1e-6))
    return norm
