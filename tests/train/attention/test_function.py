"""The packsft attention function: packed sequences never attend to each other (CPU sdpa path)."""
import pytest
import torch

from train.attention.function import BACKENDS, STRUCTURED_SDPA, AttentionContext, LayerKernels, packsft_attention
from train.attention.varlen_kernels import AttentionFeatures
from common.config import ConfigError

SDPA = LayerKernels(every=BACKENDS["sdpa"])


def tiny_qwen2(attn="packsft"):
    import train.attention.function  # noqa: F401  (registers "packsft")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    return Qwen2ForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def test_packed_forward_matches_each_sequence_alone():
    model = tiny_qwen2()
    ref = tiny_qwen2("sdpa")
    ref.load_state_dict(model.state_dict())
    lens = [5, 9, 3]
    ids = torch.randint(0, 97, (1, sum(lens)))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    ctx = AttentionContext(cu_seqlens=cu, max_seqlen=9, kernels=SDPA)
    packed = model(input_ids=ids, position_ids=pos, use_cache=False, packsft=ctx).logits[0]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = ref(input_ids=ids[:, start:end], use_cache=False).logits[0]
        torch.testing.assert_close(packed[start:end], alone, rtol=1e-5, atol=1e-5)


def test_missing_context_is_a_clear_error():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="packsft=AttentionContext"):
        packsft_attention(torch.nn.Module(), q, q, q, None)


def test_flash_backend_without_cuda_is_a_clear_error():
    """Refused when the plan is made, before any layer runs."""
    from train.plan.attention import packed_kernels
    from train.attention.varlen_kernels import NO_FEATURES

    with pytest.raises(ConfigError, match="attn_backend=flash_varlen cannot run on cpu.*attn_backend=sdpa"):
        packed_kernels("flash_varlen", torch.zeros(1, 2, 0, 4), [NO_FEATURES])


def test_a_layer_of_a_kind_the_plan_does_not_know_is_an_error():
    q = torch.zeros(1, 2, 3, 4)
    only_causal = LayerKernels(((AttentionFeatures(), SDPA.every),))
    ctx = AttentionContext(torch.tensor([0, 3], dtype=torch.int32), 3, only_causal)
    out, _ = packsft_attention(torch.nn.Module().eval(), q, q, q, None, packsft=ctx, dropout=0.5)  # eval: no dropout
    assert out.shape == (1, 3, 2, 4)
    with pytest.raises(RuntimeError, match="no attention kernel was planned for a layer with.*sliding_window=2"):
        packsft_attention(torch.nn.Module().eval(), q, q, q, None, packsft=ctx, sliding_window=2)


@pytest.mark.gpu
def test_flash_varlen_matches_sdpa_on_gpu():
    pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    cu = torch.tensor([0, 100, 350, 512], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 8, 512, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 512, 64, device="cuda", dtype=torch.bfloat16)
    module = torch.nn.Module().eval()
    flash_varlen = LayerKernels(every=BACKENDS["flash_varlen"])
    flash, _ = packsft_attention(module, q, k, v, None, packsft=AttentionContext(cu, 250, flash_varlen))
    sdpa, _ = packsft_attention(module, q.float(), k.float(), v.float(), None,
                                packsft=AttentionContext(cu, 250, SDPA))
    torch.testing.assert_close(flash.float(), sdpa, rtol=2e-2, atol=2e-2)


def test_structure_mode_without_paths_is_plain_packing():
    """All block/path ids zero: the Parallel-R1 mask reduces to the block-diagonal causal one."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    seq = torch.tensor([0] * 5 + [1] * 7)
    zeros = torch.zeros(12, dtype=torch.long)
    module = torch.nn.Module().eval()
    plain, _ = packsft_attention(module, q, k, v, None, packsft=AttentionContext(cu, 7, SDPA))
    structured, _ = packsft_attention(
        module, q, k, v, None,
        packsft=AttentionContext(cu, 7, LayerKernels(every=STRUCTURED_SDPA), seq_ids=seq, block_ids=zeros, path_ids=zeros)
    )
    torch.testing.assert_close(structured, plain, rtol=1e-5, atol=1e-6)


def test_autocast_gives_the_backend_one_dtype(monkeypatch):
    """bf16 without DeepSpeed: fp32 weights under autocast make q/k fp32 (RoPE) and v bf16; the backend must get
    all three in the autocast dtype (flash-attn and the ring backends need one half-precision dtype)."""
    import dataclasses

    import train.attention.function as attention

    seen = []
    real = attention.BACKENDS["sdpa"]

    def spy(query, key, value, *args):
        seen.append((query.dtype, key.dtype, value.dtype))
        return real.fn(query, key, value, *args)

    monkeypatch.setitem(attention.BACKENDS, "sdpa", dataclasses.replace(real, fn=spy))
    model = tiny_qwen2()
    ctx = AttentionContext(cu_seqlens=torch.tensor([0, 4, 12], dtype=torch.int32), max_seqlen=8,
                           kernels=LayerKernels(every=attention.BACKENDS["sdpa"]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.model(input_ids=torch.randint(0, 97, (1, 12)), position_ids=torch.tensor([[0, 1, 2, 3, *range(8)]]),
                    use_cache=False, packsft=ctx)
    assert seen == [(torch.bfloat16,) * 3] * 2  # both layers


def test_structured_block_mask_built_once_per_micro_batch(monkeypatch):
    """FlexAttention's BlockMask (CUDA) is the same for every layer: the context builds it once per device and
    length (the builder is stubbed: it needs CUDA)."""
    import train.attention.structured as structured

    built = []

    def fake_builder(*args):
        built.append(args[-4:-1])  # (q_len, kv_len, device), before the tree spans
        return object()

    monkeypatch.setattr(structured, "structured_block_mask", fake_builder)
    seq = torch.zeros(6, dtype=torch.long)
    ctx = AttentionContext(torch.tensor([0, 6], dtype=torch.int32), 6, seq_ids=seq, block_ids=seq, path_ids=seq)
    first = ctx.structured_block_mask(torch.device("cpu"), 6)
    assert all(ctx.structured_block_mask(torch.device("cpu"), 6) is first for _ in range(3))
    assert built == [(6, 6, torch.device("cpu"))]
    assert ctx.structured_block_mask(torch.device("cpu"), 4) is not first  # another length: rebuilt
    assert len(built) == 2
    other = AttentionContext(torch.tensor([0, 6], dtype=torch.int32), 6, seq_ids=seq, block_ids=seq, path_ids=seq)
    other.structured_block_mask(torch.device("cpu"), 6)  # a new micro-batch: its own mask
    assert len(built) == 3
