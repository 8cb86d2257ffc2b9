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
"""

import math

import torch


class OffloadedTable:
    """A [vocab, d_ff] table in host memory plus the rows the current step uses, on the device."""

    def __init__(self, weight: torch.Tensor, device: torch.device):
        self.weight = weight  # [vocab, d_ff], storage dtype, host memory
        self.device = device
        self.ids = None  # [n] sorted distinct ids of the step, on the device
        self.rows = None  # [n, d_ff] fp32 leaf on the device

    def gather(self, ids: torch.Tensor) -> None:
        """Make the rows of `ids` (any shape) the trainable rows of this step."""
        unique = ids.unique().cpu()
        self.ids = unique.to(self.device)
        self.rows = self.weight[unique].to(self.device, torch.float32).requires_grad_()

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """[..., d_ff] rows for `ids`; every id must be among those of the last `gather`."""
        return self.rows[torch.searchsorted(self.ids, ids.contiguous())]

    def __call__(self, forward, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The rows of a forward's ids, as a STEM MLP's `up_table` is called."""
        return self.lookup(forward.on(self.device)).to(device, dtype)  # [batch, seq, d_ff]

    def write_back(self) -> None:
        self.weight[self.ids.cpu()] = self.rows.detach().to("cpu", self.weight.dtype)


class RowwiseAdagrad:
    """Adagrad with one accumulator per row: G[v] += mean(g_v^2); row -= lr * g_v / (sqrt(G[v]) + eps)."""

    def __init__(self, tables: list[OffloadedTable], eps: float = 1e-8, weight_decay: float = 0.0):
        self.tables, self.eps, self.weight_decay = tables, eps, weight_decay
        self.state = [torch.zeros(t.weight.shape[0]) for t in tables]  # [vocab] per table

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for table, accum in zip(self.tables, self.state):
            ids = table.ids.cpu()
            grad = table.rows.grad  # [n, d_ff]
            accum[ids] += grad.square().mean(1).cpu()
            denom = accum[ids].to(grad.device).sqrt().add_(self.eps)[:, None]
            if self.weight_decay:
                table.rows.mul_(1 - lr * self.weight_decay)
            table.rows.addcdiv_(grad, denom, value=-lr)
            table.write_back()

    def state_dict(self) -> dict:
        return {f"accum.{i}": s for i, s in enumerate(self.state)}

    def load_state_dict(self, state: dict) -> None:
        self.state = [state[f"accum.{i}"].clone() for i in range(len(self.tables))]


class LazyAdam:
    """Adam (decoupled weight decay) applied to the touched rows only, with per-row step counts."""

    def __init__(self, tables: list[OffloadedTable], eps: float = 1e-8, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999)):
        self.tables, self.eps, self.weight_decay, self.betas = tables, eps, weight_decay, betas
        self.state = [
            {"m": torch.zeros(t.weight.shape, dtype=torch.float32), "v": torch.zeros(t.weight.shape, dtype=torch.float32),
             "t": torch.zeros(t.weight.shape[0], dtype=torch.int64)}
            for t in tables
        ]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        b1, b2 = self.betas
        for table, s in zip(self.tables, self.state):
            ids = table.ids.cpu()
            grad = table.rows.grad.cpu()
            s["t"][ids] += 1
            t = s["t"][ids].double()[:, None]
            m = s["m"][ids].mul_(b1).add_(grad, alpha=1 - b1)
            v = s["v"][ids].mul_(b2).addcmul_(grad, grad, value=1 - b2)
            s["m"][ids], s["v"][ids] = m, v
            update = (m / (1 - b1**t).float()) / ((v / (1 - b2**t).float()).sqrt() + self.eps)
            if self.weight_decay:
                table.rows.mul_(1 - lr * self.weight_decay)
            table.rows.sub_(lr * update.to(table.rows.device))
            table.write_back()

    def state_dict(self) -> dict:
        return {f"{k}.{i}": v for i, s in enumerate(self.state) for k, v in s.items()}

    def load_state_dict(self, state: dict) -> None:
        self.state = [{k: state[f"{k}.{i}"].clone() for k in ("m", "v", "t")} for i in range(len(self.tables))]


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
