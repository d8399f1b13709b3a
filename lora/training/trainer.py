"""A training step of one adapted layer that stays on the GPU: forward
(saving h), loss and its gradient, backward, optimizer step, one submit."""
from __future__ import annotations

import numpy as np

from shaderdsl.errors import BindingError

from ..core.checks import check_f16
from ..core.plan import Plan, Role
from ..core.weight import wgsl_dtype
from ..kernels.dropout import threshold
from .backward import backward_plan, dropout_plan, train_forward_plan
from .losses import LOSSES, loss_plan, loss_value, mse_parts, report_labels
from .optim import check_free


class LayerTrainer:
    """Trains one adapted layer: each step is the forward (saving h), the loss
    and its gradient, the backward and the optimizer step, recorded into one
    submit; the loss is read back only when asked for (:meth:`loss`).

    ``loss``: "mse" against a target of the output's shape, or "xent":
    softmax cross-entropy of the outputs as logits against u32 labels
    [tokens]. ``optimizer``: a lora.AdamW or lora.SGD, attached here to the
    weight's A and B. The output buffer holds the frozen base layer's output
    when a step starts and the adapted output afterwards.

    An f16 weight trains in mixed precision, as torch.autocast does: x, the
    outputs, the target and g are f16 and the products read f16 A and B,
    while the optimizer updates f32 copies (``masters``, made from the
    weight's values) and each step ends by writing their f16 rounding into
    the weight. Gradients, h and every sum are f32.

    ``lora_dropout``: peft's option of that name: the adapter's input is
    dropped (probability p, the rest scaled by 1 / (1 - p)) by a dispatch
    before the forward, the base output is not; the mask is a hash of
    (``dropout_seed``, the optimizer's step count, the element's index)
    (:func:`lora.training.backward.dropout_plan`). 0: no dispatch, the step
    of a trainer without it.
    """

    def __init__(self, device, weight, scale: float, tokens: int, optimizer, *, loss="mse",
                 forward=None, backward=None, lora_dropout: float = 0.0, dropout_seed: int = 0):
        if loss not in LOSSES:
            raise ValueError(f"loss: expected one of {LOSSES}, got {loss!r}")
        check_f16(device, weight.dtype, "LayerTrainer")
        check_free(optimizer, "LayerTrainer")
        self.device, self.tokens, self.kind, self.weight = device, tokens, loss, weight
        self.h = device.empty((tokens, weight.rank), np.float32, name="lora.h")
        self.forward = train_forward_plan(device, weight, scale, tokens, forward)
        try:  # the base copy folded into the forward (one dispatch fewer), where it can be
            self._forward_base = train_forward_plan(device, weight, scale, tokens,
                                                    self.forward.strategy, from_base=True)
        except ValueError:
            self._forward_base = None
        self.backward, dh = _backward(device, weight, scale, tokens, backward, loss)
        self.grad_a = device.empty(weight.a.shape, np.float32, name="lora.dA")
        self.grad_b = device.empty(weight.b.shape, np.float32, name="lora.dB")
        self.masters, self._to_f16 = _masters(device, weight)
        self.optimizer = optimizer
        optimizer.attach(device, [(self.masters[0], self.grad_a), (self.masters[1], self.grad_b)])
        self._begin = optimizer.folded_begin()  # the optimizer's begin, in the loss's dispatch
        self.dropout, self.x_dropped = None, None  # the plan and its xd, with lora_dropout
        if threshold(lora_dropout):  # (ValueError outside [0, 1); 0: nothing is dropped)
            self.dropout = dropout_plan(device, weight, tokens, lora_dropout, dropout_seed,
                                        optimizer.state)
            self.x_dropped = device.empty((tokens, weight.in_dim), weight.dtype,
                                          name="lora.x_dropped")
        self.loss_plan = loss_plan(device, loss, tokens, weight.out_dim, weight.dtype, self._begin,
                                   dh, seen=loss == "xent")
        weight.on_read = self.report_labels  # weight.numpy() reports them first
        self._copy = None  # (plan or None, bytes) of the base copy
        self._steps = 0    # steps recorded

    def plans(self) -> list:
        """The plans of a step given a base buffer, in order (the base copy, where
        there is one, aside)."""
        optimizer = self.optimizer.plans(begin=self._begin is None)
        return [*([self.dropout] if self.dropout else []), self._forward_base or self.forward,
                self.loss_plan, self.backward, *optimizer,
                *([self._to_f16] if self._to_f16 else [])]

    @property
    def g(self):
        """The loss's gradient with respect to the output (float32 [tokens, out_dim])."""
        return self.loss_plan.scratch["g"]

    def record(self, x_buf, out_buf, target_buf, base_buf=None) -> None:
        """One training step on a batch: x [tokens, in], out [tokens, out] (the
        adapted output afterwards), target [tokens, out] (mse) or labels u32
        [tokens] (xent), base [tokens, out]: the frozen base layer's output
        (x, out, target and base stored like the weight),
        copied into out first, in the same submit. ``base_buf`` is required:
        out holds the last prediction after a step, and training on it as if
        it were the base output diverges silently. ``base_buf=out_buf`` says
        that out already holds this batch's base output (written by you)."""
        if base_buf is None:
            raise ValueError(
                "LayerTrainer.record: base_buf is required: the frozen base layer's output "
                "for this batch [tokens, out_dim]. out_buf holds the adapted output after a "
                "step, so it cannot carry the base output to the next one; pass "
                "base_buf=out_buf only if you wrote this batch's base output into out_buf")
        self._check_batch(x_buf, out_buf)
        from_base = self._forward_base if base_buf is not out_buf else None
        if from_base is not None:
            from_base.check(x_buf, out_buf, base_buf, self.h)
        with self.device.batch():
            if self.dropout is not None:  # the adapter reads the dropped x from here on
                self.dropout.record(x_buf, self.x_dropped)
                x_buf = self.x_dropped
            if from_base is not None:
                from_base.record(x_buf, out_buf, base_buf, self.h)
            else:
                if base_buf is not out_buf:
                    self._copy_base(base_buf, out_buf)
                self.forward.record(x_buf, out_buf, self.h)
            self.loss_plan.record(out_buf, target_buf)
            self.backward.record(self.g, x_buf, self.h, self.grad_a, self.grad_b)
            self.optimizer.record(begin=self._begin is None)
            if self._to_f16:
                self._to_f16.record()
        self._steps += 1

    def _check_batch(self, x_buf, out_buf) -> None:
        """x and out as the plans were made (a smaller last batch is the common
        miss: say so, before anything is recorded)."""
        rows = getattr(x_buf, "shape", (None,))[:1]
        if rows and rows[0] is not None and len(x_buf.shape) == 2 and rows[0] != self.tokens:
            raise BindingError(f"LayerTrainer.record: this trainer takes batches of {self.tokens} "
                               f"token(s), x_buf has {rows[0]} ({x_buf!r}); make a trainer for "
                               f"{rows[0]} tokens for a smaller last batch, or drop it")
        self.forward.check(x_buf, out_buf, self.h)

    def _copy_base(self, base_buf, out_buf) -> None:
        """base -> out with a copy kernel (on the H200 copy_buffer_to_buffer moved
        84 MB in 101 us, a vec4 kernel in about 25)."""
        if base_buf.shape != out_buf.shape or base_buf.dtype != out_buf.dtype:
            raise BindingError(f"base_buf must be like output_buf ({out_buf.dtype.name} "
                               f"{out_buf.shape}), got {base_buf.dtype.name} {base_buf.shape}")
        if self._copy is None or self._copy[1] != base_buf.nbytes:
            if self._copy and self._copy[0]:
                self._copy[0].release()
            plan = None if base_buf.size % 4 else copy_plan(self.device, base_buf.size,
                                                             base_buf.dtype)
            self._copy = (plan, base_buf.nbytes)
        plan, _ = self._copy
        if plan is None:
            self.device.copy(base_buf, out_buf)
        else:
            plan.record(src=base_buf, dst=out_buf)

    def loss(self) -> float:
        """The last step's loss (reads back a small buffer: waits for the GPU).
        Labels outside the classes in any step since the last report raise
        here first (:meth:`report_labels`)."""
        if not self._steps:
            raise RuntimeError("LayerTrainer.loss: no step recorded yet; call record(...) first")
        self.report_labels()
        return loss_value(self.device, self.loss_plan)

    def gradients(self) -> tuple[np.ndarray, np.ndarray]:
        """(dA, dB) of the last step, read back (after :meth:`report_labels`)."""
        self.report_labels()
        return self.device.read(self.grad_a), self.device.read(self.grad_b)

    def report_labels(self) -> None:
        """With loss="xent": ValueError naming the first step and token whose
        label was outside the classes since the last report, which clears the
        record (a sticky record on the GPU, written by the loss's dispatch: no
        read-back a step). :meth:`loss`, :meth:`gradients` and the weight's
        ``numpy()`` (and so saving it) call this first."""
        report_labels(self.device, self.loss_plan)


def _backward(device, weight, scale, tokens, strategy, loss) -> tuple:
    """(the backward plan, what the loss plan gets to write its dh: None, or
    (B, scale, dh) at one token with mse and split, one dispatch fewer)."""
    if loss == "mse" and tokens == 1:
        try:
            plan = backward_plan(device, weight, scale, tokens, strategy, with_dx=False,
                                 dh_parts=mse_parts(weight.out_dim))
            return plan, (weight.b, scale, plan.scratch["dh"])
        except ValueError:  # a backward that computes dh itself
            pass
    return backward_plan(device, weight, scale, tokens, strategy, with_dx=False), None


def _masters(device, weight) -> tuple:
    """(the f32 buffers the optimizer updates, the plan that writes their f16
    rounding into an f16 weight, or None): A and B themselves for f32."""
    if weight.dtype == np.float32:
        return (weight.a, weight.b), None
    masters = tuple(device.buffer(v.astype(np.float32), name=f"lora.{n}32")
                    for v, n in zip(weight.numpy(), "AB"))
    weight.masters = masters  # Weight.write keeps them in step
    return masters, Plan(device, "f16 copies of A and B", [("to_f16", dict(
        sizes=(weight.a.size, weight.b.size)))], {}, bound={
        "p0": masters[0], "p1": masters[1], "h0": weight.a, "h1": weight.b})


def copy_plan(device, n: int, dtype=np.float32) -> Plan:
    """dst = src for ``n`` values of ``dtype`` (a multiple of 4: a vec4 per thread)."""
    dt = np.dtype(dtype)
    return Plan(device, f"copy {n} {dt.name}", [("copy", dict(n4=n // 4, dtype=wgsl_dtype(dt)))],
                {"src": Role("src", dt, (n,), per_token=False),
                 "dst": Role("dst", dt, (n,), per_token=False, writes=True)})
