"""Distillation and cross-entropy on the LM head, in chunks of positions.

Full-vocabulary logits for a whole batch never exist at once: for each chunk of positions the
student's (and the teacher's) logits are computed, the loss and its gradient with respect to the
logits are formed in closed form, and the gradients for the hidden states and the head weight are
accumulated right there. Backward then only scales what forward stored; nothing is recomputed.

    loss = (ce_weight * CE(targets, p) [where ce_mask] + kd_weight * T^2 * KL(q_T || p_T)) / normalizer
    d loss / d z = (ce_weight * (p - onehot) [where ce_mask] + kd_weight * T * (p_T - q_T)) / normalizer

`ce_mask` leaves positions out of the cross-entropy only (text the teacher generated: its tokens
are a sample of the distribution the KL term already matches in full).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK_LOGIT_BYTES = 64 * 2**20
IGNORE = -100


@dataclass(frozen=True)
class HeadLoss:
    """How logits are formed from the final hidden states, and how the losses are weighted."""

    ce_weight: float = 1.0
    kd_weight: float = 1.0
    temperature: float = 1.0
    scale: float = 1.0  # logits = hidden @ W^T * scale (Granite divides by logits_scaling)
    softcap: float | None = None  # logits = softcap * tanh(logits / softcap) (Gemma 2)
    chunk_tokens: int = 0  # 0: as many positions as fit CHUNK_LOGIT_BYTES of fp32 logits

    @classmethod
    def for_config(cls, config, **weights) -> "HeadLoss":
        """The logit transform the family applies after its LM head, read from the model config."""
        return cls(scale=1.0 / float(getattr(config, "logits_scaling", 1.0) or 1.0),
                   softcap=getattr(config, "final_logit_softcapping", None) or None, **weights)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(fp32 logits [n, vocab], tanh of the capped logits or None) for hidden states [n, d]."""
        z = (hidden @ weight.to(hidden.dtype).T) * self.scale
        z = z.to(torch.promote_types(z.dtype, torch.float32))  # softmax in fp32 (or better)
        if self.softcap is None:
            return z, None
        t = torch.tanh(z / self.softcap)
        return self.softcap * t, t


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, targets, ce_mask, spec, normalizer):
        # hidden [n, d], weight [vocab, d], teacher_hidden [n, d_teacher] or None, targets [n], ce_mask [n]
        n, vocab = hidden.shape[0], weight.shape[0]
        step = spec.chunk_tokens or max(16, CHUNK_LOGIT_BYTES // (4 * vocab))
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if want_h else None
        precise = torch.promote_types(hidden.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=precise, device=weight.device) if want_w else None
        # nll (cross-entropy positions), kl, top-1 agreements, targets, cross-entropy positions
        sums = torch.zeros(5, dtype=torch.float64, device=hidden.device)
        T = spec.temperature
        for start in range(0, n, step):
            h = hidden[start : start + step]
            y = targets[start : start + step]
            valid = y != IGNORE
            scored = valid & ce_mask[start : start + step]  # positions with a cross-entropy term
            z, t = spec.logits(h, weight)  # [c, vocab]
            logp = F.log_softmax(z, -1)
            p = logp.exp()
            # Masks multiply or select, never index: a boolean index or nonzero() waits for the device each time
            target = y.clamp_min(0)[:, None]  # [c, 1]
            nll = -logp.gather(1, target)[:, 0]
            sums[0] += torch.where(scored, nll, 0).sum().double()
            sums[3] += valid.sum()
            sums[4] += scored.sum()
            grad_z = spec.ce_weight * p * scored[:, None]
            grad_z.scatter_add_(1, target, -spec.ce_weight * scored[:, None].to(grad_z.dtype))
            if teacher_hidden is not None:
                zt, _ = spec.logits(teacher_hidden[start : start + step], teacher_weight)
                logq_t = F.log_softmax(zt / T, -1)
                logp_t = logp if T == 1 else F.log_softmax(z / T, -1)
                kl = (logq_t.exp() * (logq_t - logp_t)).sum(-1) * T * T
                sums[1] += torch.where(valid, kl, 0).sum().double()
                sums[2] += ((z.argmax(-1) == zt.argmax(-1)) & valid).sum()
                grad_z += spec.kd_weight * T * (logp_t.exp() - logq_t.exp())
            if not (want_h or want_w):
                continue
            grad_z *= valid[:, None] / normalizer
            if t is not None:
                grad_z *= 1 - t * t  # through softcap * tanh(z / softcap)
            grad_z *= spec.scale
            if want_h:
                grad_h[start : start + step] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
            if want_w:
                grad_w += grad_z.T @ h.to(precise)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        loss = (spec.ce_weight * sums[0] + spec.kd_weight * sums[1]) / normalizer
        ctx.mark_non_differentiable(sums)
        return loss.float(), sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        grad_h, grad_w = ctx.saved_tensors
        out_h = grad_h * grad_loss if grad_h is not None else None
        out_w = (grad_w * grad_loss).to(ctx.weight_dtype) if grad_w is not None else None
        return out_h, out_w, None, None, None, None, None, None


def head_loss(spec: HeadLoss, hidden, weight, targets, teacher_hidden=None, teacher_weight=None, normalizer: float = 1.0,
              ce_mask=None):
    """(loss, sums) for final hidden states [n, d]; sums = [nll, kl, top-1 agreements, targets, cross-entropy
    positions] (float64), nll summed over the cross-entropy positions (`ce_mask`, default all).

    The loss is the weighted sum over positions divided by `normalizer` (the number of targets the
    whole optimizer step averages over), so that accumulated micro-batches add up to a mean."""
    if teacher_hidden is None and spec.kd_weight:
        raise ValueError("distillation (kd_weight > 0) needs the teacher's hidden states")
    if ce_mask is None:
        ce_mask = torch.ones_like(targets, dtype=torch.bool)
    return _ChunkedHeadLoss.apply(hidden, weight, teacher_hidden, teacher_weight, targets, ce_mask, spec,
                                  float(normalizer))
