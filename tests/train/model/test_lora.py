"""LoRA via peft (train/model/lora.py): only adapters train, exports reload with the same logits."""
import os

import pytest
import torch
import torch.nn.functional as F

import train.attention.function  # noqa: F401  (registers attn_implementation="packsft")
from train.attention.function import BACKENDS, AttentionContext, LayerKernels
from train.model.lora import apply_lora, base_causal_lm, merged_state_dict, save_lora

SDPA_KERNELS = LayerKernels(every=BACKENDS["sdpa"])  # every layer through the SDPA loop

VOCAB = 96


def tiny_qwen2(seed: int = 0, tie: bool = True):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    config._attn_implementation = "packsft"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def packed_batch(seed: int = 1):
    """Two sequences packed in one row (lengths 7 and 5), with the packsft attention context."""
    g = torch.Generator().manual_seed(seed)
    lens = [7, 5]
    input_ids = torch.randint(0, VOCAB, (1, sum(lens)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    targets = torch.cat([torch.cat([input_ids[0, s + 1 : s + n], torch.tensor([-100])]) for s, n in ((0, 7), (7, 5))])
    return input_ids, position_ids, cu, max(lens), targets


def forward_logits(model, batch):
    input_ids, position_ids, cu, max_len, _ = batch
    ctx = AttentionContext(cu_seqlens=cu, max_seqlen=max_len, kernels=SDPA_KERNELS)
    return model(input_ids=input_ids, position_ids=position_ids, packsft=ctx, use_cache=False).logits[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    model = apply_lora(tiny_qwen2(), lora_rank=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    batch = packed_batch()
    losses = []
    model.train()
    for _ in range(8):
        loss = F.cross_entropy(forward_logits(model, batch), batch[4], ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    out = tmp_path_factory.mktemp("lora") / "export"
    save_lora(model, out, merge=True)
    return model, before, losses, out


def test_only_adapters_train_and_loss_falls(trained):
    model, before, losses, _ = trained
    assert losses[-1] < losses[0] - 0.1, losses
    names = [n for n, _ in model.named_parameters()]
    adapter = [n for n in names if "lora_" in n]
    assert len(adapter) == 2 * 7 * 2  # 2 layers x (q,k,v,o,gate,up,down) x (A,B)
    assert not any("lm_head" in n or "embed_tokens" in n for n in adapter)
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == ("lora_" in name), name
        assert p.requires_grad == ("lora_" in name), name


def test_adapter_reloads_with_same_logits(trained):
    from peft import PeftModel

    model, _, _, out = trained
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    reloaded = PeftModel.from_pretrained(tiny_qwen2(), str(out)).eval()  # base rebuilt from the same init
    batch = packed_batch()
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(reloaded, batch), forward_logits(model, batch), rtol=0, atol=1e-6)
        untrained = forward_logits(tiny_qwen2(), batch)
        assert not torch.allclose(untrained, forward_logits(model, batch), atol=1e-3)


def test_merged_export_loads_with_same_logits(trained):
    from transformers import AutoModelForCausalLM

    model, before, _, out = trained
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), attn_implementation="packsft").eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    batch = packed_batch()
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(merged, batch), forward_logits(model, batch), rtol=1e-5, atol=1e-5)
    # folding a given (e.g. ZeRO-3 consolidated) state dict gives the same weights as the live parameters
    live, given = merged_state_dict(model), merged_state_dict(model, state_dict=model.state_dict())
    assert live.keys() == given.keys() == tiny_qwen2().state_dict().keys()
    for key in live:
        assert torch.equal(live[key], given[key]), key
    # exporting never touched the training weights
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p.detach(), before[name])


def test_target_list_untied_head_and_errors(tmp_path):
    model = apply_lora(tiny_qwen2(tie=False), lora_rank=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in model.named_parameters() if "lora_" in n}
    assert adapted == {"q_proj", "v_proj"}
    # kwargs (position_ids, packsft) reach the attention function through peft: it raises without the context
    assert forward_logits(model, packed_batch()).shape == (12, VOCAB)
    with pytest.raises(RuntimeError, match="packsft"):
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), use_cache=False)
    assert base_causal_lm(model).lm_head.weight.requires_grad is False
    sd = merged_state_dict(model)
    assert set(sd) == set(tiny_qwen2(tie=False).state_dict())
    from types import SimpleNamespace

    cfg = SimpleNamespace(lora_rank=2, lora_alpha=4.0, lora_dropout=0.0, target_modules=["all-linear"])
    from_cfg = apply_lora(tiny_qwen2(), cfg)  # the trainer's form: settings from its config
    assert from_cfg.peft_config["default"].r == 2 and from_cfg.peft_config["default"].lora_alpha == 4.0
    assert sum("lora_A" in n for n, _ in from_cfg.named_parameters()) == 2 * 7
    with pytest.raises(ValueError, match="never adapted"):
        apply_lora(tiny_qwen2(), 2, 4, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="match no module"):
        apply_lora(tiny_qwen2(), 2, 4, target_modules=["qkv_proj"])
    with pytest.raises(ValueError, match="lora_rank"):
        apply_lora(tiny_qwen2(), 0, 4)
    with pytest.raises(ValueError, match="no peft adapters"):
        save_lora(tiny_qwen2(), tmp_path / "x")


@pytest.mark.multiprocess
def test_trainer_zero2_and_sp_two_processes_match_one_process(tmp_path):
    """LoRA through the trainer: DeepSpeed ZeRO-2 on 2 CPU processes (1 row per rank per step), and sequence
    parallelism over 2 processes, give the same adapter as 1 process without DeepSpeed accumulating the same
    2 rows; the export reloads with peft."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests._train_helpers import random_rows, run_train, save_tiny_model, tiny_model, write_config, write_packed

    packed = write_packed(tmp_path / "packed", random_rows(0, 6))
    model_dir = save_tiny_model(tmp_path / "model")
    # adam_eps=1 makes AdamW's update ~ lr * gradient for these small gradients: a gradient scale error shows
    # (with the usual eps, Adam's update is scale-free and amplifies rounding noise in tiny gradients)
    common = dict(data_path=str(packed), model_path=str(model_dir), max_steps=3, lr=1.0, adam_eps=1.0,
                  schedule="constant", max_grad_norm=0.0, lora_rank=4, lora_alpha=8,
                  target_modules=["q_proj", "v_proj", "down_proj"], lora_merge_on_save=True, plot=False,
                  tokenizer_mismatch="warn")
    config = write_config(tmp_path / "train.yaml", output_dir=str(tmp_path / "unused"), **common)
    ds_out, sp_out, ref_out = tmp_path / "zero2", tmp_path / "sp2", tmp_path / "single"
    run_train(config, [f"output_dir={ds_out}", "deepspeed.stage=2", "grad_accum=1"], nproc=2)
    run_train(config, [f"output_dir={sp_out}", "sequence_parallel_size=2", "launch.num_processes=2",
                       "grad_accum=2", "attn_backend=sdpa"], nproc=2)
    from train.config.sections import load_config
    from train.trainer import Trainer

    Trainer(load_config(config, [f"output_dir={ref_out}", "grad_accum=2"])).train()  # in-process: no startup cost

    want = load_file(ref_out / "final" / "adapter_model.safetensors")
    for run in (ds_out, sp_out):
        got = load_file(run / "final" / "adapter_model.safetensors")
        assert got.keys() == want.keys() and len(got) == 2 * 3 * 2
        for key in want:
            scale = float(want[key].abs().max())
            assert scale > 0, f"{key} never trained"
            assert float((got[key] - want[key]).abs().max()) <= 1e-5 * scale, f"{run.name}: {key}"

    base = tiny_model()
    merged = AutoModelForCausalLM.from_pretrained(ds_out / "final" / "merged", attn_implementation="packsft").eval()
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    for key, value in base_sd.items():  # only the adapted projections moved
        adapted = any(f".{m}." in key for m in ("q_proj", "v_proj", "down_proj")) and key.endswith("weight")
        assert torch.equal(merged_sd[key], value) != adapted, key
    reloaded = PeftModel.from_pretrained(tiny_model(), str(ds_out / "final")).eval()
    ids = torch.arange(3, 19)[None]
    batch = (ids, torch.arange(16)[None], torch.tensor([0, 16], dtype=torch.int32), 16, None)
    with torch.no_grad():
        torch.testing.assert_close(forward_logits(reloaded, batch), forward_logits(merged, batch), rtol=1e-5, atol=1e-5)


def _zero3_worker(rank: int, world: int, port: int, out_dir: str, steps: int) -> None:
    """One rank of a ZeRO-3 run built with deepspeed.initialize; every rank calls save_lora (gathers)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed

    from train.engines.deepspeed_config import skip_unused_cpu_comm_op

    skip_unused_cpu_comm_op()  # as the trainer does: no JIT build of an op training never calls
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = apply_lora(tiny_qwen2(tie=False), lora_rank=4, lora_alpha=8, target_modules="all-linear")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1.0, eps=1.0)  # ~ SGD
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1 << 30,
              "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    assert any(hasattr(p, "ds_id") and p.numel() == 0 for p in engine.module.parameters()), "not partitioned"
    for step in range(steps):
        batch = packed_batch(100 * step + rank)
        loss = F.cross_entropy(forward_logits(engine, batch), batch[4], ignore_index=-100)
        engine.backward(loss)
        engine.step()
    save_lora(engine, out_dir, merge=True)
    # an orderly gloo shutdown: a rank that exits with live communicator threads can abort ("terminate called
    # without an active exception") while the other still tears down
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.multiprocess
def test_deepspeed_zero3_save_gathers_partitions(tmp_path):
    """ZeRO-3 partitions the adapter too: save_lora gathers it (collective on both ranks); the export equals a
    single-process run on the same global batches (DeepSpeed averages the 2 ranks' gradients)."""
    import torch.multiprocessing as mp
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests._train_helpers import free_port

    steps, out = 2, tmp_path / "zero3"
    mp.spawn(_zero3_worker, args=(2, free_port(), str(out), steps), nprocs=2, join=True)

    ref = apply_lora(tiny_qwen2(tie=False), lora_rank=4, lora_alpha=8, target_modules="all-linear")
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1.0, eps=1.0)
    for step in range(steps):
        losses = []
        for rank in range(2):
            batch = packed_batch(100 * step + rank)
            losses.append(F.cross_entropy(forward_logits(ref, batch), batch[4], ignore_index=-100))
        opt.zero_grad()
        (sum(losses) / 2).backward()
        opt.step()
    ref.eval()
    batch = packed_batch(7)
    reloaded = PeftModel.from_pretrained(tiny_qwen2(tie=False), str(out)).eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", attn_implementation="packsft").eval()
    with torch.no_grad():
        want = forward_logits(ref, batch)
        assert not torch.allclose(want, forward_logits(tiny_qwen2(tie=False), batch), atol=1e-3)
        torch.testing.assert_close(forward_logits(reloaded, batch), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(forward_logits(merged, batch), want, rtol=1e-4, atol=1e-5)
