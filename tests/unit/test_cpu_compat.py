"""One test per behaviour the CPU compatibility layer changes in Megatron-Core / torch."""

from __future__ import annotations

import pytest
import torch

from rlhf.distributed.cpu_compat import apply_cpu_compat, is_cuda_device
from tests.helpers import REPO, python_output

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="layer is CPU-only")


@pytest.fixture(scope="module", autouse=True)
def compat():
    assert apply_cpu_compat() is True


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo world with Megatron's parallel state (TP = PP = 1)."""
    from rlhf.distributed.bootstrap import init_parallel, teardown

    init_parallel("cpu")
    yield
    teardown()


def test_is_cuda_device_spellings():
    assert is_cuda_device("cuda") and is_cuda_device("cuda:1") and is_cuda_device(0)
    assert is_cuda_device(torch.device("cuda", 0))
    assert not is_cuda_device("cpu") and not is_cuda_device(True) and not is_cuda_device(None)


def test_current_device_is_usable_as_a_device():
    assert torch.cuda.current_device() == 0
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_rotary_embedding_on_cpu_matches_hand_computation():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000)
    emb = rope(4)  # [seq, 1, 1, dim]
    assert emb.device.type == "cpu" and emb.shape == (4, 1, 1, 8)
    inv_freq = [1.0 / 10000 ** (i / 8) for i in (0, 2, 4, 6)]
    expected = torch.tensor([[p * f for f in inv_freq] * 2 for p in range(4)])
    torch.testing.assert_close(emb[:, 0, 0, :], expected)


def test_rotation_with_tables_once_equals_megatrons_bitwise():
    """`RopeTables` (installed in Megatron's rope_utils) against the function it wraps, inside
    one decoder forward's scope: values and gradients, fp32 and bf16, a YaRN scale, a
    second table of the same length within the scope (a table's cos/sin must not serve
    another), and a partial rotation (Megatron's own); nothing kept after the scope."""
    from megatron.core.models.common.embeddings import rope_utils

    from rlhf.distributed.cpu_compat import RopeTables

    rope = rope_utils._apply_rotary_pos_emb_bshd
    assert isinstance(rope, RopeTables)
    gen = torch.Generator().manual_seed(0)
    with rope.kept():
        for dtype, mscale, rotated in [
            (torch.float32, 1.0, 16),
            (torch.bfloat16, 1.0, 16),
            (torch.float32, 0.7, 16),
            (torch.float32, 1.0, 8),
        ]:
            for _ in range(2):  # a fresh table each time
                freqs = torch.randn(6, 1, 1, rotated, generator=gen) * 3
                t = torch.randn(6, 2, 3, 16, generator=gen).to(dtype).requires_grad_()
                ours = rope(t, freqs, mscale=mscale)
                theirs = rope.original(t, freqs, mscale=mscale)
                assert torch.equal(ours, theirs)
                weights = torch.randn(ours.shape, generator=gen).to(dtype)
                grads = [torch.autograd.grad((x * weights).sum(), t)[0] for x in (ours, theirs)]
                assert torch.equal(*grads)
        assert rope.tables
    assert not rope.tables


def test_a_decoder_forward_keeps_the_rotary_tables_only_while_it_runs():
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.transformer_block import TransformerBlock

    rope = rope_utils._apply_rotary_pos_emb_bshd
    seen = []

    def forward(block):
        rope(torch.ones(2, 1, 1, 4), torch.zeros(2, 1, 1, 4))
        seen.append(len(rope.tables))

    rope.per_forward(forward)(None)
    assert seen == [1] and not rope.tables
    assert TransformerBlock.forward.__wrapped__ is not None  # installed on the decoder


def test_synchronize_is_a_no_op():
    assert torch.cuda.synchronize() is None


def test_cuda_device_tensors_land_on_cpu():
    from megatron.core.transformer.utils import get_default_causal_mask

    assert torch.zeros(3, device="cuda").device.type == "cpu"
    assert torch.tensor([1.0]).to("cuda").device.type == "cpu"
    mask = get_default_causal_mask(3)
    assert mask.device.type == "cpu"
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]


def test_pinned_host_tensors_need_no_driver():
    # Megatron's context-parallel RoPE slicing builds its index with pin_memory=True
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    t = torch.tensor([1, 2], device="cpu", pin_memory=True).cuda(non_blocking=True)
    assert t.tolist() == [1, 2] and not t.is_pinned()

    class FakeGroup:  # rank 1 of 2: zig-zag chunks 1 and 2 of 4
        def size(self):
            return 2

        def rank(self):
            return 1

    emb = torch.arange(8.0).reshape(8, 1, 1, 1)
    local = get_pos_emb_on_this_cp_rank(emb, 0, FakeGroup())
    assert local.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]


def test_cuda_method_and_type_names():
    x = torch.ones(2)
    assert x.cuda() is x
    assert x.type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert x.type("torch.cuda.HalfTensor").dtype == torch.float16


def test_megatron_grad_norm_runs_on_cpu(one_rank):
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32

    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    assert get_grad_norm_fp32(grads) == pytest.approx(5.0)


def test_rng_tracker_uses_cpu_generator(one_rank):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(0)
    before = torch.rand(2)
    with tracker.fork():
        tp_draw = torch.rand(3)
    after = torch.rand(2)
    # The default stream is untouched by the fork ...
    torch.manual_seed(0)
    torch.testing.assert_close(torch.cat([before, after]), torch.rand(4))
    # ... and the model-parallel stream is seed + 2718 + tp_rank, Megatron's rule,
    # continuing where it left off at the next fork.
    reference = torch.Generator().manual_seed(123 + 2718)
    torch.testing.assert_close(tp_draw, torch.rand(3, generator=reference))
    with tracker.fork():
        next_draw = torch.rand(3)
    torch.testing.assert_close(next_draw, torch.rand(3, generator=reference))


def test_rng_tracker_rejects_duplicate_seeds_and_names(one_rank):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(Exception, match="seed 1 already exists"):
        tracker.add("b", 1)
    with pytest.raises(Exception, match="rng state a already exists"):
        tracker.add("a", 2)


def test_custom_backward_allocations_on_the_current_device_land_on_cpu():
    """Megatron's sequence-parallel gathers allocate on `torch.cuda.current_device()` in
    their backward, which the autograd engine runs inside `torch.autograd.backward`."""

    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            out = torch.empty(grad.shape, device=torch.cuda.current_device())
            return out.copy_(2 * grad)

    x = torch.ones(3, requires_grad=True)
    torch.autograd.backward(Doubling.apply(x).sum())
    assert x.grad is not None and x.grad.device.type == "cpu"
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_cuda_streams_are_the_host_queue():
    """The MoE all-to-all dispatcher copies its split sizes on a side stream and waits on it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.ones(2)
    side.record_event().synchronize()
    assert x.sum().item() == 2.0


def test_moe_dispatcher_split_sizes_become_numpy_on_the_host():
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    sizes = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
    assert isinstance(sizes, np.ndarray) and sizes.tolist() == [3, 1]
    assert moe_utils.te_general_gemm is None  # the router's torch.mm path without TE
    logits = moe_utils.router_gating_linear(torch.ones(2, 3), torch.eye(3), None, torch.float32)
    assert torch.equal(logits, torch.ones(2, 3))


def test_unequal_gather_and_reduce_scatter_on_one_rank(one_rank):
    """The unequal paths themselves run on 2 and 4 gloo ranks in
    tests/distributed/test_moe_parity.py (expert-TP 2); on one rank they are the identity."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    group = parallel_state.get_tensor_model_parallel_group()
    x = torch.arange(6.0).view(3, 2)
    assert torch.equal(mappings._gather_along_first_dim(x, group, [3]), x)
    assert torch.equal(mappings._reduce_scatter_along_first_dim(x, group, [3]), x)


FUSERS = """
import sys, inspect
from rlhf.distributed import cpu_compat
print("installed", cpu_compat.plain_megatron_fusers())
from megatron.core import jit
from megatron.core.fusions import fused_bias_dropout
print("plain", jit.jit_fuser is jit.noop_decorator,
      inspect.isfunction(fused_bias_dropout.bias_dropout_add_fused_train))
print("dynamo imported", "torch._dynamo" in sys.modules)
print("again", cpu_compat.plain_megatron_fusers())
"""

THROUGH_THE_CLI = """
import sys
from rlhf.cli import train
code = train.main(["--config", {config!r}, "actor_rollout_ref.model.path=/no/such/model",
                   "trainer.default_local_dir=" + {run_dir!r}])
from megatron.core import jit
print("exit", code, "plain", jit.jit_fuser is jit.noop_decorator)
"""


def test_megatrons_fusers_stay_plain_functions_and_import_no_compiler():
    """`plain_megatron_fusers` before Megatron-Core's import: its `jit_fuser` stays a plain
    decorator (`torch.compile` otherwise), so importing it imports no TorchDynamo; called
    once Megatron-Core is imported it changes nothing and says so."""
    out = python_output(FUSERS)
    assert "installed True" in out and "again False" in out, out
    assert "plain True True" in out, out
    assert "dynamo imported False" in out, out


def test_a_cpu_run_of_the_trainer_sets_them_before_its_imports(tmp_path):
    """`rlhf-train` on the CPU (here one that stops at its checks: no model) imported
    Megatron-Core with the plain decorator."""
    config = str(REPO / "configs" / "quickstart_cpu.yaml")
    out = python_output(THROUGH_THE_CLI.format(config=config, run_dir=str(tmp_path / "run")))
    assert "exit 2 plain True" in out, out
