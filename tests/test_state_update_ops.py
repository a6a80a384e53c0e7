"""State updated by compound and bounded in-place ops, on the host simulator.

``lerp_``, ``addcmul_``, ``addcdiv_`` and ``add_(..., alpha=)`` are spelled out
before annotation (otherwise the QNN context binary does not build); ``clamp_`` on
state must clamp although its output shares the state encoding, which is wider than
the bounds (the HTP clips a ReluMinMax to its output encoding, not to its bounds).
A plain 16-bit clamp has the same problem through the observer's headroom.
"""

import pytest
import torch
from bar import assert_identical
from models import ranged

from qnn_mutbuf import HostRunner, lower, quantize
from qnn_mutbuf.verify import EagerRunner, compare_steps, output_scales

STEPS = 12
BOUND = 0.3


class ClampedWalk(torch.nn.Module):
    """A random walk kept inside [-BOUND, BOUND]: the unclamped sum leaves it.

    Its steps are the inputs, centred on zero. (With ``add_(x - 0.475)`` instead, the
    HTP's fixed-point rounding of the summand differs from PyTorch's by one step for
    some inputs, and a sum integrates that: not what this test is about.)"""

    INPUT_SHIFT = -0.475

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("walk", torch.zeros(1, 16))

    def forward(self, x):
        self.walk.add_(x).clamp_(-BOUND, BOUND)
        return self.walk + 0


class Lerp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.full((1, 16), 0.5))

    def forward(self, x):
        self.avg.lerp_(x, 0.25)
        return self.avg + 0


class Addcmul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("energy", torch.zeros(1, 16))

    def forward(self, x):
        self.energy.mul_(0.5).addcmul_(x, x, value=0.25)
        return self.energy + 0


class Addcdiv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ratio", torch.zeros(1, 16))

    def forward(self, x):
        self.ratio.mul_(0.5).addcdiv_(x, x + 1.0, value=0.5)
        return self.ratio + 0


class AlphaSum(torch.nn.Module):
    """``add_`` with alpha. A dyadic alpha (0.125) makes x * alpha land exactly
    half-way between two state steps for some x; PyTorch rounds those ties to even,
    the HTP does not always, and the sum integrates the difference (measured: 2 steps
    after 12 steps at 16a8w). A non-dyadic alpha has no exact ties."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(1, 16))

    def forward(self, x):
        self.acc.add_(x, alpha=0.3)
        return self.acc + 0


class TanhCell(torch.nn.Module):
    """An RNN cell, h = tanh(W x + U h): the HTP's 16-bit tanh takes only its own fixed
    output encoding, so the state stores a requantized copy of it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.input = torch.nn.Linear(16, 16)
        self.recurrent = torch.nn.Linear(16, 16, bias=False)
        self.register_buffer("h", torch.zeros(1, 16))

    def forward(self, x):
        self.h.copy_(torch.tanh(self.input(x) + self.recurrent(self.h)))
        return self.h + 0


class PlainClamp(torch.nn.Module):
    """No state: a clamp of an activation whose encoding has 16-bit headroom."""

    def forward(self, x):
        return (torch.clamp(x * 2.0, 0.25, 1.5),)


# A state that multiplies itself requantizes every step and the HTP rounds a little
# differently (as in the in-place bar): bounded, not growing. The HTP's 16-bit
# division is approximate on its own: x / (x + 1) without any state is 11 output
# steps (5e-5) from fake-quant at 16a8w, 1 step at 8a8w (measured); its tanh is 4
# output steps from fake-quant without any state (tanh(linear(x)), measured).
CONTRACTING, DIVISION_16_BIT, TANH_16_BIT = 3.0, 12.0, 8.0

CASES = {
    # name: (model factory, {quant: steps of the state encoding allowed from fake-quant})
    "clamped_walk": (ClampedWalk, {"8a8w": 1.0, "16a8w": 1.0}),
    "lerp": (Lerp, {"8a8w": CONTRACTING, "16a8w": CONTRACTING}),
    "addcmul": (Addcmul, {"8a8w": CONTRACTING, "16a8w": CONTRACTING}),
    "addcdiv": (Addcdiv, {"8a8w": CONTRACTING, "16a8w": DIVISION_16_BIT}),
    "tanh_cell": (TanhCell, {"8a8w": CONTRACTING, "16a8w": TANH_16_BIT}),
    "alpha_sum": (AlphaSum, {"8a8w": 1.0, "16a8w": 1.0}),
    "plain_clamp": (PlainClamp, {"8a8w": 1.0, "16a8w": 1.0}),
}


def steps(count, seed, shift=0.0):
    generator = torch.Generator().manual_seed(seed)
    return [(ranged((1, 16), generator) + shift,) for _ in range(count)]


@pytest.mark.parametrize("quant", ["8a8w", "16a8w"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_update_tracks_references(case, quant, host_sdk):
    make_model, allowed_steps = CASES[case]
    allowed = allowed_steps[quant]
    model = make_model().eval()
    shift = getattr(model, "INPUT_SHIFT", 0.0)
    inputs = steps(STEPS, 3, shift)
    quantized = quantize(model, steps(STEPS, 2, shift), quant=quant)
    state_scales = [e.scale for e in quantized.meta["qnn_mutbuf"].state_encodings.values()]
    out_scale = max(s for s in output_scales(quantized) if s)
    unit = max([out_scale, *state_scales])
    # A state step off becomes up to one more output step when the output encoding is
    # finer than the state's.
    limit = allowed * unit * 1.001 + (out_scale if state_scales else 0.0) + 1e-6

    program = lower(quantized, inputs[0])
    assert program.qnn_mutbuf_report.cpu_ops == [], program.qnn_mutbuf_report.cpu_ops
    runner = HostRunner(program.buffer)
    device = runner.run(inputs)
    fake_quant = EagerRunner(quantized).run(inputs)
    fp32 = EagerRunner(model).run(inputs)

    for row in compare_steps("fake-quant", fake_quant, device).rows:
        assert row.max_abs_error <= limit, (
            f"step {row.step}: {row.max_abs_error / unit:.2f} steps of {unit:.3g} from fake-quant"
        )
    assert compare_steps("fp32", fp32, device).min_sqnr() >= (15.0 if quant == "8a8w" else 30.0)
    if case == "clamped_walk":
        walk = torch.stack([outputs[0] for outputs in device])
        assert walk.abs().max() <= BOUND + unit, "the clamp on the state did not clamp"
        assert (walk.abs() >= BOUND - unit).any(), "the walk never reached the bound"
    if case == "plain_clamp":
        clamped = torch.stack([outputs[0] for outputs in device])
        assert clamped.min() >= 0.25 - unit and clamped.max() <= 1.5 + unit

    runner.reset()
    assert_identical(device, runner.run(inputs), "after reset")


class TensorBoundedWalk(torch.nn.Module):
    """Clamped by tensor bounds: ``clamp.Tensor`` has no HTP builder, so it runs on
    the CPU, and the state it writes must stay at top level with it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("walk", torch.zeros(1, 16))
        self.register_buffer("low", torch.full((1, 16), -BOUND))
        self.register_buffer("high", torch.full((1, 16), BOUND))

    def forward(self, x):
        self.walk.add_(x).clamp_(self.low, self.high)
        return self.walk + 0


def test_state_written_on_the_cpu_stays_at_top_level(host_sdk):
    model = TensorBoundedWalk().eval()
    inputs = steps(STEPS, 3, ClampedWalk.INPUT_SHIFT)
    quantized = quantize(model, steps(STEPS, 2, ClampedWalk.INPUT_SHIFT), quant="16a8w")
    (state_scale,) = [e.scale for e in quantized.meta["qnn_mutbuf"].state_encodings.values()]

    program = lower(quantized, inputs[0], delegate_mutable_buffers=True)
    report = program.qnn_mutbuf_report
    assert any("clamp.Tensor" in op for op in report.cpu_ops), report.cpu_ops
    assert "walk" in report.top_level_buffers and "walk" not in report.delegated_buffers
    device = HostRunner(program.buffer).run(inputs)
    fake_quant = EagerRunner(quantized).run(inputs)
    out_scale = max(s for s in output_scales(quantized) if s)
    # The float state the CPU hands back enters the delegate through the HTP's input
    # Quantize, which rounds through float16 (measured: values come back on the fp16
    # grid): half an fp16 spacing near the bound, bounded, not growing over the steps.
    fp16_rounding = torch.finfo(torch.float16).eps * 0.25 / 2  # |v| in [0.25, 0.5)
    limit = fp16_rounding + state_scale + out_scale + 1e-6
    for row in compare_steps("fake-quant", fake_quant, device).rows:
        assert row.max_abs_error <= limit, row
    walk = torch.stack([outputs[0] for outputs in device])
    assert walk.abs().max() <= BOUND + limit


@pytest.mark.parametrize("case", ["lerp", "addcmul", "addcdiv"])
def test_compound_updates_in_fp16(case, host_sdk):
    """fp16 lowering spells the compound ops out as well (else: no context binary)."""
    make_model, _ = CASES[case]
    inputs = steps(STEPS, 3)
    program = lower(make_model().eval(), inputs[0], fp16=True)
    assert program.qnn_mutbuf_report.cpu_ops == [], program.qnn_mutbuf_report.cpu_ops
    device = HostRunner(program.buffer).run(inputs)
    fp32 = EagerRunner(make_model().eval()).run(inputs)
    assert compare_steps("fp32", fp32, device).min_sqnr() >= 60.0
