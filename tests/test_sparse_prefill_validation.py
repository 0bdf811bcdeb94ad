"""``cute_mla.flash_mla_sparse_fwd`` refuses bad arguments by name, on the host.

Every check runs before any launch and before the device check, so these run on CPU tensors on a
machine without a GPU (CI). Each case asserts a ValueError (a wrong dtype: TypeError or ValueError)
whose message starts with the argument's name ("q: ...", "kv: ...", "indices: ...", "d_v: ...",
"attn_sink: ...", "topk_length: ...", "out: ..."), or with the quantity the argument's shape gives
("d_qk: ...", "topk: ..."); an unsupported head count names h_q. Well-formed CPU arguments get past
every check and stop at the device check.
"""

import pytest
import torch

import cute_mla
from cute_mla.archs import UnsupportedDeviceError

# A wrong dtype: TypeError (flash_mla_with_kvcache's convention) or ValueError.
DTYPE_ERROR = (TypeError, ValueError)
# messages that may name the quantity rather than the tensor
D_QK_MSG = "^(q|d_qk):"
H_Q_MSG = "h_q"
TOPK_MSG = "^(indices|topk):"

S_Q, H_Q, D_QK, S_KV, TOPK = 2, 64, 576, 256, 128
BF16, I32 = torch.bfloat16, torch.int32


def good(**over):
    kw = dict(
        q=torch.zeros(S_Q, H_Q, D_QK, dtype=BF16),
        kv=torch.zeros(S_KV, 1, D_QK, dtype=BF16),
        indices=torch.zeros(S_Q, 1, TOPK, dtype=I32),
        sm_scale=0.04,
        d_v=512,
        attn_sink=None,
        topk_length=None,
        out=None,
    )
    kw.update(over)
    return kw


def call(**over):
    return cute_mla.flash_mla_sparse_fwd(**good(**over))


def _strided_last(shape, dtype):
    """A tensor of ``shape`` whose last dim has stride 2."""
    return torch.zeros(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]


_Q = torch.zeros(S_Q, H_Q, D_QK, dtype=BF16)
_KV = torch.zeros(S_KV, 1, D_QK, dtype=BF16)      # 256 x 576 elements: room for a whole out

CASES = [
    # (argument overrides, exception, message pattern)
    # q
    (dict(q=torch.zeros(S_Q, H_Q, D_QK, dtype=torch.float16)), DTYPE_ERROR, "^q:"),
    (dict(q=torch.zeros(S_Q, H_Q, D_QK, dtype=torch.float32)), DTYPE_ERROR, "^q:"),
    (dict(q=torch.zeros(1, S_Q, H_Q, D_QK, dtype=BF16)), ValueError, "^q:"),
    (dict(q=torch.zeros(S_Q * H_Q, D_QK, dtype=BF16)), ValueError, "^q:"),
    (dict(q=torch.zeros(S_Q, H_Q, 640, dtype=BF16), kv=torch.zeros(S_KV, 1, 640, dtype=BF16)), ValueError, D_QK_MSG),
    (dict(q=torch.zeros(S_Q, H_Q, 128, dtype=BF16), kv=torch.zeros(S_KV, 1, 128, dtype=BF16)), ValueError, D_QK_MSG),
    (dict(q=torch.zeros(S_Q, 48, D_QK, dtype=BF16)), ValueError, H_Q_MSG),
    (dict(q=torch.zeros(S_Q, 4, D_QK, dtype=BF16)), ValueError, H_Q_MSG),
    (dict(q=torch.zeros(S_Q, 256, D_QK, dtype=BF16)), ValueError, H_Q_MSG),
    (dict(q=torch.zeros(S_Q, 1, D_QK, dtype=BF16)), ValueError, H_Q_MSG),
    (dict(q=_strided_last((S_Q, H_Q, D_QK), BF16)), ValueError, "^q:"),
    # kv
    (dict(kv=torch.zeros(S_KV, 1, D_QK, dtype=torch.float16)), DTYPE_ERROR, "^kv:"),
    (dict(kv=torch.zeros(S_KV, 1, D_QK, dtype=torch.uint8)), DTYPE_ERROR, "^kv:"),
    (dict(kv=torch.zeros(S_KV, D_QK, dtype=BF16)), ValueError, "^kv:"),
    (dict(kv=torch.zeros(1, S_KV, 1, D_QK, dtype=BF16)), ValueError, "^kv:"),
    (dict(kv=torch.zeros(S_KV, 2, D_QK, dtype=BF16)), ValueError, "^kv:"),
    (dict(kv=torch.zeros(S_KV, 1, 512, dtype=BF16)), ValueError, "^kv:"),        # d_qk differs from q's
    (dict(kv=_strided_last((S_KV, 1, D_QK), BF16)), ValueError, "^kv:"),
    # indices
    (dict(indices=torch.zeros(S_Q, 1, TOPK, dtype=torch.int64)), DTYPE_ERROR, "^indices:"),
    (dict(indices=torch.zeros(S_Q, 1, TOPK, dtype=torch.float32)), DTYPE_ERROR, "^indices:"),
    (dict(indices=torch.zeros(S_Q, TOPK, dtype=I32)), ValueError, "^indices:"),
    (dict(indices=torch.zeros(1, S_Q, 1, TOPK, dtype=I32)), ValueError, "^indices:"),
    (dict(indices=torch.zeros(S_Q, 2, TOPK, dtype=I32)), ValueError, "^indices:"),   # h_kv is 1
    (dict(indices=torch.zeros(S_Q + 1, 1, TOPK, dtype=I32)), ValueError, "^indices:"),  # s_q differs from q's
    (dict(indices=torch.zeros(S_Q, 1, 100, dtype=I32)), ValueError, TOPK_MSG),    # topk % 64 != 0
    (dict(indices=torch.zeros(S_Q, 1, 32, dtype=I32)), ValueError, TOPK_MSG),
    (dict(indices=torch.zeros(S_Q, 1, 0, dtype=I32)), ValueError, TOPK_MSG),      # topk must be positive
    (dict(indices=_strided_last((S_Q, 1, TOPK), I32)), ValueError, "^indices:"),
    # d_v
    (dict(d_v=576), ValueError, "^d_v:"),
    (dict(d_v=448), ValueError, "^d_v:"),
    (dict(d_v=0), ValueError, "^d_v:"),
    # attn_sink
    (dict(attn_sink=torch.zeros(H_Q, dtype=BF16)), DTYPE_ERROR, "^attn_sink:"),
    (dict(attn_sink=torch.zeros(H_Q, dtype=torch.float64)), DTYPE_ERROR, "^attn_sink:"),
    (dict(attn_sink=torch.zeros(2 * H_Q)), ValueError, "^attn_sink:"),
    (dict(attn_sink=torch.zeros(H_Q // 2)), ValueError, "^attn_sink:"),
    (dict(attn_sink=torch.zeros(1, H_Q)), ValueError, "^attn_sink:"),
    # topk_length
    (dict(topk_length=torch.zeros(S_Q, dtype=torch.int64)), DTYPE_ERROR, "^topk_length:"),
    (dict(topk_length=torch.zeros(S_Q, dtype=torch.float32)), DTYPE_ERROR, "^topk_length:"),
    (dict(topk_length=torch.zeros(S_Q + 1, dtype=I32)), ValueError, "^topk_length:"),
    (dict(topk_length=torch.zeros(S_Q, 1, dtype=I32)), ValueError, "^topk_length:"),
    # out
    (dict(out=torch.zeros(S_Q, H_Q, D_QK, dtype=BF16)), ValueError, "^out:"),
    (dict(out=torch.zeros(S_Q, H_Q // 2, 512, dtype=BF16)), ValueError, "^out:"),
    (dict(out=torch.zeros(S_Q + 1, H_Q, 512, dtype=BF16)), ValueError, "^out:"),
    (dict(out=torch.zeros(1, S_Q, H_Q, 512, dtype=BF16)), ValueError, "^out:"),
    (dict(out=torch.zeros(S_Q, H_Q, 512, dtype=torch.float32)), DTYPE_ERROR, "^out:"),
    (dict(out=torch.zeros(S_Q, H_Q, 512, dtype=torch.float16)), DTYPE_ERROR, "^out:"),
    (dict(out=_strided_last((S_Q, H_Q, 512), BF16)), ValueError, "^out:"),
    # out's elements overlap: the rows (stride 0), or the heads (8 columns apart)
    (dict(out=torch.zeros(1, H_Q, 512, dtype=BF16).expand(S_Q, H_Q, 512)), ValueError, "^out:"),
    (dict(out=torch.zeros(S_Q * H_Q * 512, dtype=BF16).as_strided((S_Q, H_Q, 512), (H_Q * 512, 8, 1))), ValueError, "^out:"),
    # out sharing bytes with an input
    (dict(q=_Q, out=_Q[..., :512]), ValueError, "^out:"),
    (dict(kv=_KV, out=_KV.view(-1)[:S_Q * H_Q * 512].view(S_Q, H_Q, 512)), ValueError, "^out:"),
]


@pytest.mark.parametrize("over,exc,msg", CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_rejected_argument(over, exc, msg):
    with pytest.raises(exc, match=msg):
        call(**over)


def _head_slice_out(s_q, h_q):
    """Heads [3, 3 + h_q) of a wider (s_q, 2 h_q + 5, 512) bf16 tensor: strided rows, contiguous last dim."""
    return torch.zeros(s_q, 2 * h_q + 5, 512, dtype=BF16)[:, 3:3 + h_q]


@pytest.mark.parametrize("h_q", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("d_qk", [576, 512])
@pytest.mark.parametrize("features", ["none", "sink_length", "out", "out_head_slice", "strided_inputs"])
def test_valid_arguments_reach_the_device_check(h_q, d_qk, features):
    """Well-formed calls pass every host check: on CPU tensors the device check is what stops them
    (so the cases above fail for the reason they name)."""
    s_q, s_kv, topk = 3, 100, 192         # s_kv < topk is allowed (out-of-range indices are invalid slots)
    kw = dict(q=torch.zeros(s_q, h_q, d_qk, dtype=BF16), kv=torch.zeros(s_kv, 1, d_qk, dtype=BF16),
              indices=torch.zeros(s_q, 1, topk, dtype=I32), sm_scale=d_qk ** -0.5, d_v=512)
    if features == "sink_length":
        kw.update(attn_sink=torch.zeros(h_q), topk_length=torch.zeros(s_q, dtype=I32))
    elif features == "out":
        kw.update(out=torch.zeros(s_q, h_q, 512, dtype=BF16))
    elif features == "out_head_slice":
        kw.update(out=_head_slice_out(s_q, h_q))
    elif features == "strided_inputs":
        # FlashMLA's tests' layout: every dim + 1, the last + 128, sliced back (last dim contiguous)
        kw.update(q=torch.zeros(s_q + 1, h_q + 1, d_qk + 128, dtype=BF16)[:s_q, :h_q, :d_qk],
                  kv=torch.zeros(s_kv + 1, 2, d_qk + 128, dtype=BF16)[:s_kv, :1, :d_qk],
                  indices=torch.zeros(s_q + 1, 2, topk + 128, dtype=I32)[:s_q, :1, :topk])
    with pytest.raises(UnsupportedDeviceError):
        cute_mla.flash_mla_sparse_fwd(**kw)


def test_launcher_follows_the_config_its_plan_compiles(monkeypatch):
    """A launcher per compiled config: plans that differ in the lengths alone share one, and
    plans whose kv is on either side of the L2 (which the 128-head d_qk 576 rule reads for the row
    prefetch) get their own, in either order, as does a variant. The kernel module is stubbed, so
    nothing compiles."""
    from cute_mla import archs
    from cute_mla.interface import prefill
    from cute_mla.plan.sparse_prefill import plan_sparse_prefill

    class Stub:
        compile = staticmethod(lambda cfg: ("compiled", cfg))

    monkeypatch.setattr(prefill.registry, "kernel_module", lambda op, arch: Stub)
    monkeypatch.setattr(prefill, "_by_config", {})
    monkeypatch.setattr(prefill, "_by_plan", {})
    past_l2 = archs.SM90.l2_bytes // (576 * 2) + 1
    fits, past = (plan_sparse_prefill(4096, 128, 576, 2048, arch="sm_90a", s_kv=n) for n in (8192, past_l2))
    a, b = prefill.launcher_of(fits, True), prefill.launcher_of(past, True)
    assert (a.cfg.tuning.prefetch_rows, b.cfg.tuning.prefetch_rows) == (False, True)
    assert a.compiled == ("compiled", a.cfg) and b is not a
    for s_q, s_kv, same in ((7, 1024, a), (4096, 2 * past_l2, b), (1, past_l2, b)):
        assert prefill.launcher_of(plan_sparse_prefill(s_q, 128, 576, 2048, arch="sm_90a", s_kv=s_kv), True) is same
    assert prefill.launcher_of(fits, False) is not a
    variant = prefill.launcher_of(fits, True, prefill.registry.config_module(fits.op, fits.arch).Tuning(prefetch_rows=True))
    assert variant.cfg == b.cfg and variant is b     # a variant naming the rule's other choice is that config
    monkeypatch.setattr(prefill, "_MAX_PLANS", 2)
    prefill._by_plan.clear()
    assert prefill.launcher_of(past, True) is b and prefill.launcher_of(fits, True) is a
    assert prefill.launcher_of(plan_sparse_prefill(3, 128, 576, 2048, arch="sm_90a", s_kv=64), True) is a
    assert len(prefill._by_plan) == 1 and len(prefill._by_config) == 3     # the full table was cleared


def test_launcher_runs_a_scale_its_config_does_not_take_on_the_any_scale_form(monkeypatch):
    """A call whose scale the config does not take (the ping-pong's ``ffma_exp``: zero, negative
    or subnormal) launches the config's ``any_scale`` form, made on first use and kept; any other
    scale, and every scale of a config that takes them all, the launcher's own kernel. The kernel
    module is stubbed: each launch records the config it ran."""
    from cute_mla.interface import prefill
    from cute_mla.kernels import SparsePrefillTensors
    from cute_mla.plan.sparse_prefill import plan_sparse_prefill

    ran = []

    class Stub:
        compile = staticmethod(lambda cfg: cfg)
        launch = staticmethod(lambda compiled, cfg, t: ran.append((compiled, cfg, t.softmax_scale)))

    monkeypatch.setattr(prefill.registry, "kernel_module", lambda op, arch: Stub)
    monkeypatch.setattr(prefill, "_by_config", {})
    monkeypatch.setattr(prefill, "_by_plan", {})
    pingpong = prefill.launcher_of(plan_sparse_prefill(4096, 128, 576, 2048, arch="sm_90a", s_kv=8192), True)
    swapped = prefill.launcher_of(plan_sparse_prefill(4096, 16, 576, 2048, arch="sm_90a", s_kv=8192), True)
    assert pingpong.cfg.tuning.ffma_exp and not swapped.cfg.tuning.ffma_exp
    scales = (0.0416, -0.0416, 0.0, 1e-39, 0.5)
    for launcher in (pingpong, swapped):
        for x in scales:
            launcher(SparsePrefillTensors(*[None] * 8, softmax_scale=x))
    any_form = pingpong.cfg.any_scale()
    assert ran == ([(pingpong.cfg, pingpong.cfg, 0.0416)] + [(any_form, any_form, x) for x in scales[1:4]]
                   + [(pingpong.cfg, pingpong.cfg, 0.5)] + [(swapped.cfg, swapped.cfg, x) for x in scales])
    assert pingpong.any_scale() is prefill._by_config["sm_90a", any_form] and swapped.any_scale() is swapped
    assert pingpong.any_scale().any_scale() is pingpong.any_scale()


def test_a_call_signature_launches_through_its_bound_launch(monkeypatch):
    """A call signature binds its launch once (the kernel module's ``bind``: s_q and the device's SMs
    fixed) and its calls launch through it, heads padded where the arch's kernel wants them (SM100's
    at 16 heads); a scale the config does not take goes through the launcher's bundle to the
    ``any_scale`` form, and s_q 0 launches nothing. The kernel module is stubbed: each launch
    records what it ran (how, the config's arch and one-FFMA softmax, the heads it saw)."""
    from cute_mla.interface import prefill

    ran, binds = [], []

    def what(how, cfg, q):
        return how, cfg.arch, getattr(cfg.tuning, "ffma_exp", None), q.shape[1]

    class Stub:
        compile = staticmethod(lambda cfg: cfg)
        launch = staticmethod(lambda compiled, cfg, t: ran.append(what("bundle", cfg, t.q)))

        @staticmethod
        def bind(compiled, cfg, s_q, num_sms):
            binds.append((cfg.arch, s_q, num_sms))
            return lambda q, kv, indices, topk_length, attn_sink, out, max_logits, lse, softmax_scale: ran.append(
                what("bound", cfg, q))

    arch = ["sm_90a"]
    monkeypatch.setattr(prefill, "_require_cuda", lambda q: None)
    monkeypatch.setattr(prefill.ops, "device_facts", lambda device: (arch[0], 132))
    monkeypatch.setattr(prefill.registry, "kernel_module", lambda op, arch: Stub)
    for table in ("_by_config", "_by_plan", "_checked"):
        monkeypatch.setattr(prefill, table, {})
    for _ in range(3):
        call(sm_scale=0.5)
    assert binds == [("sm_90a", S_Q, 132)] and ran == [("bound", "sm_90a", True, H_Q)] * 3
    call(sm_scale=-0.5)                                        # the any_scale form, through the bundle
    call(sm_scale=0.0)
    assert len(binds) == 1 and ran[3:] == [("bundle", "sm_90a", False, H_Q)] * 2
    ran.clear()
    call(q=torch.zeros(S_Q, 16, D_QK, dtype=BF16), attn_sink=torch.zeros(16))      # SM90's swap-AB tile
    assert ran == [("bound", "sm_90a", False, 16)]
    call(q=torch.zeros(0, H_Q, D_QK, dtype=BF16), indices=torch.zeros(0, 1, TOPK, dtype=I32))
    assert len(ran) == 1 and len(binds) == 2
    prefill._checked.clear()
    arch[0] = "sm_100a"
    out, max_logits, lse = call(q=torch.zeros(S_Q, 16, D_QK, dtype=BF16), attn_sink=torch.zeros(16))
    assert ran[1:] == [("bound", "sm_100a", None, 64)] and binds[-1] == ("sm_100a", S_Q, 132)    # padded to 64
    assert out.shape == (S_Q, 16, 512) and max_logits.shape == lse.shape == (S_Q, 16)


def test_checked_signature_is_not_rechecked_but_any_change_is(monkeypatch):
    """The argument checks run once per call signature (every layer of a prefill step has the
    same); the scale is checked on every call, an out is kept apart from the inputs on every call,
    and a call whose tensors differ in anything checked runs the checks again and fails as before.
    The CUDA requirement, the device's facts, the kernel and the launch are stubbed so that this
    runs on a CPU."""
    from cute_mla.interface import prefill

    monkeypatch.setattr(prefill, "_require_cuda", lambda q: None)
    monkeypatch.setattr(prefill.ops, "device_facts", lambda device: ("sm_90a", 132))
    plans = []

    class Launcher:
        bind = staticmethod(lambda s_q, num_sms: None)

    monkeypatch.setattr(prefill, "launcher_of", lambda plan, has_attn_sink, tuning=None: plans.append(plan) or Launcher)
    monkeypatch.setattr(prefill, "_run", lambda plan, launcher, launch, *args: (None, None, None))
    monkeypatch.setattr(prefill, "_checked", {})
    runs = []
    full = prefill.check_call
    monkeypatch.setattr(prefill, "check_call", lambda *a: runs.append(1) or full(*a))
    buf = torch.zeros(S_Q * H_Q * D_QK + S_Q * H_Q * 512 + 64, dtype=BF16)
    q = buf[:S_Q * H_Q * D_QK].view(S_Q, H_Q, D_QK)
    beside = buf[S_Q * H_Q * D_QK:S_Q * H_Q * D_QK + S_Q * H_Q * 512].view(S_Q, H_Q, 512)
    inside = buf[64:64 + S_Q * H_Q * 512].view(S_Q, H_Q, 512)     # 128 bytes in: beside's alignment
    call(q=q, out=beside)
    call(q=q.clone(), out=beside.clone(), sm_scale=0.5)                 # the same signature
    assert len(runs) == 1 and len(prefill._checked) == 1
    assert len(plans) == 1 and plans[0].s_kv == S_KV and plans[0].s_q == S_Q     # planned once per signature
    with pytest.raises(ValueError, match="^sm_scale: got inf"):
        call(q=q, out=beside, sm_scale=float("inf"))
    with pytest.raises(ValueError, match=r"^out: its memory \[0x[0-9a-f]+, 0x[0-9a-f]+\) overlaps q's"):
        call(q=q, out=inside)
    assert len(runs) == 1
    bad = [
        (dict(indices=torch.zeros(S_Q, 1, TOPK, dtype=torch.int64)), DTYPE_ERROR, "^indices:"),
        (dict(q=torch.zeros(S_Q * H_Q * D_QK + 1, dtype=BF16)[1:].view(S_Q, H_Q, D_QK)), ValueError,
         "^q: the data pointer must be 16-byte aligned"),
        (dict(out=torch.zeros(S_Q, H_Q, 256, dtype=BF16)), ValueError, "^out:"),
        (dict(attn_sink=[0.0] * H_Q), TypeError, "^attn_sink: expected a torch.Tensor"),
        (dict(d_v=256), ValueError, "^d_v: got 256"),
        (dict(q=torch._neg_view(torch.zeros(S_Q, H_Q, D_QK, dtype=BF16))), ValueError, "^q: a lazily negated view"),
        (dict(q=_strided_last((S_Q, H_Q, D_QK), BF16)), ValueError, "^q: the last dim must be contiguous"),
    ]
    for over, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            call(**over)
    assert len(runs) == 1 + len(bad)
    # kv's rows are part of the signature and of the plan: past the L2 is another plan
    from cute_mla import archs
    past_l2 = archs.SM90.l2_bytes // (D_QK * 2) + 1
    call(q=q, out=beside, kv=torch.zeros(past_l2, 1, D_QK, dtype=BF16))
    assert len(runs) == 2 + len(bad) and [p.kv_fits_l2 for p in plans] == [True, False]


def test_a_call_switches_device_only_off_the_current_one(monkeypatch):
    """The eager call launches inside a device guard only when its tensors are on a CUDA device
    other than the current one (``launcher.call_on_device_of``); on the current device, or off
    CUDA, it calls straight through. The device query and the guard are stubbed."""
    from cute_mla.interface import launcher

    entered = []

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append("left")

    class On:    # a tensor as far as the guard reads it: its device index (-1 off CUDA)
        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    monkeypatch.setattr(launcher, "_current_cuda_device", lambda: 1)
    monkeypatch.setattr(launcher.torch.cuda, "device", Guard)
    for index in (-1, 1):
        assert launcher.call_on_device_of(On(index), lambda *a: a, 2, 3) == (2, 3)
    assert entered == []
    assert launcher.call_on_device_of(On(0), lambda: entered.append("ran") or "ran") == "ran"
    assert entered == [0, "ran", "left"]
    assert launcher.on_device_of(torch.zeros(1)) is launcher._SAME_DEVICE
