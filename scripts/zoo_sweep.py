#!/usr/bin/env python3
"""Try architectures beyond the test zoo's against torch.optim.AdamW, as the zoo does.

Each model is built tiny and random from its transformers config class (no hub access), trained a
few steps at stage 0, stage 2 (optimizer on cpu) and stage 3 (parameters and optimizer on nvme)
with the zoo's configs (default, scaled, the DeepSpeed form), and compared with AdamW on an
identical copy by tests/test_zoo.py's own check. A row that fails names the error; a failure of
the harness itself (a config this transformers version refuses) says REFERENCE FAILED. The zoo's
comparison refuses a run where more than 1% of the model's elements had a noise-sized gradient
("noise elements"): equal losses with that message are the harness's limit, not a defect.

With --patterns it runs the plain-torch patterns of tests/_zoo_patterns.py instead (PENDING ones
too) through every check of tests/test_zoo.py: each stage and config form, a bit-exact resume at
each stage and a meta build from a weights file (with --dp 2: D = 2 at each form); a row of a
check that PENDING lists says "pending" after its verdict, and one that passes asks for its entry
to go. --markdown ends with the grid docs/zoo.md shows.

    python scripts/zoo_sweep.py                      # every architecture below
    python scripts/zoo_sweep.py clip reformer --forms 3-default
    python scripts/zoo_sweep.py deepseekv3 clip --dp 2 --forms 2-default,3-scaled
    python scripts/zoo_sweep.py --patterns --markdown  # every pattern, every check
    python scripts/zoo_sweep.py --patterns --dp 2 --markdown
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
FORMS = ("0-default", "2-default", "3-default", "3-scaled", "3-deepspeed")
DP_FORMS = ("0-default", "2-default", "3-scaled", "3-deepspeed")  # test_zoo's D > 1 forms


def _models(T: Any, V: int) -> dict[str, Callable[[], Any]]:
    c = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=V, max_position_embeddings=64)

    def lm(cls: Any, cfg: Any, **kw: Any) -> Callable[[], Any]:
        return lambda: cls(cfg(**kw))
    return {
        "gemma2": lm(T.Gemma2ForCausalLM, T.Gemma2Config, **c, head_dim=8),
        "gemma3": lm(T.Gemma3ForCausalLM, T.Gemma3TextConfig, **c, head_dim=8),
        "phi3": lm(T.Phi3ForCausalLM, T.Phi3Config, **c, pad_token_id=0),
        "olmo2": lm(T.Olmo2ForCausalLM, T.Olmo2Config, **c),
        "gptneox": lm(T.GPTNeoXForCausalLM, T.GPTNeoXConfig, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, vocab_size=V, max_position_embeddings=64),
        "falcon": lm(T.FalconForCausalLM, T.FalconConfig, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=V, hidden_dropout=0.0, attention_dropout=0.0),
        "bloom": lm(T.BloomForCausalLM, T.BloomConfig, hidden_size=32, n_layer=2, n_head=4, vocab_size=V,
                    hidden_dropout=0.0, attention_dropout=0.0),
        "gptj": lm(T.GPTJForCausalLM, T.GPTJConfig, n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64,
                   rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "opt": lm(T.OPTForCausalLM, T.OPTConfig, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=V, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0),
        "qwen3moe": lm(T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig, **c, head_dim=8, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, decoder_sparse_step=1),
        "olmoe": lm(T.OlmoeForCausalLM, T.OlmoeConfig, **c, num_experts=4, num_experts_per_tok=2),
        "granitemoe": lm(T.GraniteMoeForCausalLM, T.GraniteMoeConfig, **c, num_local_experts=4, num_experts_per_tok=2),
        "deepseekv3": lm(T.DeepseekV3ForCausalLM, T.DeepseekV3Config, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         vocab_size=V, max_position_embeddings=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                         topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8),
        "jamba": lm(T.JambaForCausalLM, T.JambaConfig, **c, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                    attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4,
                    mamba_expand=2, use_mamba_kernels=False),
        "mamba": lm(T.MambaForCausalLM, T.MambaConfig, hidden_size=32, num_hidden_layers=2, vocab_size=V, state_size=4,
                    expand=2, conv_kernel=4),
        "recurrent_gemma": lm(T.RecurrentGemmaForCausalLM, T.RecurrentGemmaConfig, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                              lru_width=32, attention_window_size=16, block_types=["recurrent", "attention"], head_dim=8),
        "reformer": lm(T.ReformerModelWithLMHead, T.ReformerConfig, vocab_size=V, hidden_size=16, num_attention_heads=2,
                       attention_head_size=8, feed_forward_size=32, attn_layers=["local", "local"], axial_pos_embds=False,
                       is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       local_attention_probs_dropout_prob=0.0, local_attn_chunk_length=4, max_position_embeddings=64,
                       pad_token_id=0),
        "bart": lm(T.BartForConditionalGeneration, T.BartConfig, d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, vocab_size=V,
                   max_position_embeddings=64, dropout=0.0),
        "whisper": lm(T.WhisperForConditionalGeneration, T.WhisperConfig, vocab_size=V, num_mel_bins=8, d_model=32,
                      encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                      encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16,
                      dropout=0.0, decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      suppress_tokens=None, begin_suppress_tokens=None),
        "roberta": lm(T.RobertaForMaskedLM, T.RobertaConfig, vocab_size=V, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0),
        "deberta_v2": lm(T.DebertaV2ForMaskedLM, T.DebertaV2Config, vocab_size=V, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, relative_attention=True, position_buckets=8),
        "modernbert": lm(T.ModernBertForMaskedLM, T.ModernBertConfig, vocab_size=V, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                         mask_token_id=3, reference_compile=False),
        "wav2vec2": lm(T.Wav2Vec2ForCTC, T.Wav2Vec2Config, vocab_size=V, hidden_size=16, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8), conv_stride=(2, 2), conv_kernel=(3, 3),
                       num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                       layerdrop=0.0, mask_time_prob=0.0, ctc_loss_reduction="mean", pad_token_id=0),
        "convnext": lm(T.ConvNextForImageClassification, T.ConvNextConfig, num_stages=2, hidden_sizes=[8, 16],
                       depths=[1, 1], num_labels=5, image_size=32),
        "swin": lm(T.SwinForImageClassification, T.SwinConfig, image_size=32, patch_size=4, embed_dim=8, depths=[1, 1],
                   num_heads=[2, 2], window_size=4, num_labels=5, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, drop_path_rate=0.0),
        "clip": lm(T.CLIPModel, T.CLIPConfig, projection_dim=16,
                   text_config=dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, max_position_embeddings=16, bos_token_id=0,
                                    pad_token_id=1, eos_token_id=2),  # 2: pooled at the argmax id (see CLIPTextTransformer)
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      image_size=16, patch_size=4)),
        "llava": lambda: T.LlavaForConditionalGeneration(T.LlavaConfig(
            text_config=T.LlamaConfig(**c), image_token_index=V - 1, projector_hidden_act="gelu",
            vision_config=T.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=8, patch_size=4), vision_feature_layer=-1)),
        "blip2": lambda: T.Blip2ForConditionalGeneration(T.Blip2Config(
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                               image_size=8, patch_size=4),
            qformer_config=dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                encoder_hidden_size=16, vocab_size=V, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0),
            text_config=T.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=V,
                                    word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0,
                                    attention_dropout=0.0).to_dict(),
            num_query_tokens=4, image_token_index=V - 1)),
    }


def _batches(zoo: Any, torch: Any, V: int) -> dict[str, Callable[[int, int], dict]]:
    def speech(step: int, rows: int) -> dict:
        g = zoo._gen(step)
        return {"input_values": torch.randn(rows, 200, generator=g), "labels": torch.randint(1, V, (rows, 6), generator=g)}

    def audio(step: int, rows: int) -> dict:
        g = zoo._gen(step)
        return {"input_features": torch.randn(rows, 8, 32, generator=g),
                "labels": torch.randint(3, V, (rows, 4), generator=g)}

    def pairs(step: int, rows: int) -> dict:
        g = zoo._gen(step)
        return {"input_ids": torch.randint(0, V, (rows, 8), generator=g),
                "pixel_values": torch.randn(rows, 3, 16, 16, generator=g)}

    def image_text(first: int, count: int) -> Callable[[int, int], dict]:
        def make(step: int, rows: int) -> dict:
            g = zoo._gen(step)
            ids = torch.randint(0, V - 1, (rows, 10), generator=g)
            ids[:, first:first + count] = V - 1  # the image tokens
            return {"input_ids": ids, "pixel_values": torch.randn(rows, 3, 8, 8, generator=g), "labels": ids.clone()}
        return make

    def chunked(step: int, rows: int) -> dict:  # Reformer: a multiple of its chunk length
        ids = torch.randint(1, V, (rows, 8), generator=zoo._gen(step))
        return {"input_ids": ids, "labels": ids.clone()}
    return {"bart": zoo.tokens_seq2seq, "roberta": zoo.tokens_mlm, "deberta_v2": zoo.tokens_mlm,
            "modernbert": zoo.tokens_mlm, "convnext": zoo.images(32, 5), "swin": zoo.images(32, 5), "whisper": audio,
            "wav2vec2": speech, "clip": pairs, "llava": image_text(1, 4), "blip2": image_text(0, 4), "reformer": chunked}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="architectures, or patterns with --patterns (default: all)")
    p.add_argument("--forms", default=None, help=f"checks, comma-separated: stage-form pairs of {FORMS} (default; "
                   f"with --dp, {DP_FORMS}); with --patterns, of tests/_zoo_patterns.CHECKS (default: all)")
    p.add_argument("--patterns", action="store_true", help="the plain-torch patterns instead of the architectures")
    p.add_argument("--markdown", action="store_true", help="end with a markdown grid of the verdicts")
    p.add_argument("--workdir", default=None, help="folder for the nvme tier (default: a temp dir)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (gloo, spawned under a timeout)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    import _zoo_models as zoo
    import _zoo_patterns as patterns
    import test_zoo as tz

    torch.set_num_threads(1)
    known = list(patterns.PATTERNS) if args.patterns else list(_models(transformers, zoo.VOCAB))
    names = args.names or known
    unknown = sorted(set(names) - set(known))
    if unknown:
        p.error(f"unknown {'patterns' if args.patterns else 'architectures'} {unknown}; choose from {sorted(known)}")
    default = DP_FORMS if args.dp > 1 else tuple(c for c in patterns.CHECKS if c not in patterns.DP) \
        if args.patterns else FORMS
    forms = tuple(args.forms.split(",")) if args.forms else default
    if args.dp > 1:
        from _dist import run_ranks

        run_ranks(_rank, args.dp, timeout=1800, names=tuple(names), forms=forms, patterns=args.patterns,
                  markdown=args.markdown)
        return
    if not args.patterns:
        _register(names)
    verdicts = {}
    for name in names:
        for form in forms:
            verdicts[name, form] = _verdict(name, form, _check(tz, name, form, args.workdir), args.patterns)
            print(f"{name:28} {form:12} {verdicts[name, form]}", flush=True)
    if args.markdown:
        print(_grid(names, forms, verdicts))


def _register(names: list[str] | tuple[str, ...]) -> None:
    """The architectures as cases of the zoo (tests/_zoo_models.CASES), in this process."""
    import torch
    import transformers

    import _zoo_models as zoo

    models, batches = _models(transformers, zoo.VOCAB), _batches(zoo, torch, zoo.VOCAB)
    for name in names:
        loss = (lambda f, b: f(**b, return_loss=True).loss) if name == "clip" else zoo.hf_loss
        zoo.CASES[name] = zoo.Case(name, zoo._seeded(models[name]), batches.get(name, zoo.tokens_lm), loss)


def _rank(rank: int, world: int, names: tuple[str, ...], forms: tuple[str, ...], patterns: bool = False,
          markdown: bool = False) -> None:
    """One rank of a --dp run: test_zoo's own D > 1 case on each architecture (or pattern) and
    form; rank 0 prints the rows (and the grid)."""
    import torch

    import test_zoo as tz
    from zero_offload import comm

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if not patterns:
        _register(names)
    verdicts = {}
    for name in names:
        for form in forms:
            stage, kind = int(form.split("-")[0]), form.split("-")[1]
            try:
                tz._rank_case(name, stage, kind, rank, world, comm)
                row = "ok"
            except Exception as exc:
                row = _failure(exc)
            verdicts[name, f"D={world} {form}"] = _verdict(name, f"D=2 {form}", row, patterns) if world == 2 else row
            if rank == 0:
                print(f"{name:28} {form:12} D={world} {verdicts[name, f'D={world} {form}']}", flush=True)
    if rank == 0 and markdown:
        print(_grid(list(names), tuple(f"D={world} {f}" for f in forms), verdicts))


def _check(tz: Any, name: str, form: str, workdir: str | None) -> str:
    """One check of test_zoo on one case: "ok", or the failure's first lines."""
    import pathlib

    with tempfile.TemporaryDirectory(dir=workdir) as d:
        try:
            if form.startswith("resume "):
                tz.check_resume(name, int(form.split()[1]), pathlib.Path(d))
                return "ok"
            if form == "meta":
                if tz.zoo.CASES[name].meta_build is None:
                    return "n/a (torch cannot build it on the meta device)"
                tz.check_pattern_meta(name, pathlib.Path(d))
                return "ok"
            stage, kind = int(form.split("-")[0]), form.split("-")[1]
            try:
                ref = tz.reference(name, kind)
            except Exception as exc:
                return f"REFERENCE FAILED {type(exc).__name__}: {str(exc)[:200]}"
            losses, state = tz.run_engine(name, tz.config_for(kind, stage, d, units=tz.unit_bytes(name)))
            tz.check_against(name, losses, state, ref)
        except Exception as exc:
            return _failure(exc)
    return "ok"


def _verdict(name: str, check: str, row: str, patterns: bool) -> str:
    """A pattern's row marked when PENDING lists its check: still failing, or to be switched on."""
    if not patterns:
        return row
    import _zoo_patterns

    if check not in _zoo_patterns.PENDING.get(name, ((), ""))[0]:
        return row
    return "ok (pending: remove it from PENDING)" if row == "ok" else f"{row} (pending)"


def _noise_only(verdict: str) -> bool:
    """A failed comparison whose losses agree to 1e-6 and that names noise elements: the harness's
    limit (more than 1% of the elements got a noise-sized gradient, see the module docstring)."""
    import re

    m = re.search(r"loss rel err ([0-9.e+-]+)", verdict)
    return bool(m) and float(m.group(1)) <= 1e-6 and "noise elements" in verdict


def _grid(names: list[str], forms: tuple[str, ...], verdicts: dict[tuple[str, str], str]) -> str:
    """The verdicts as a markdown table: a row per case, a column per check."""
    def cell(v: str) -> str:
        word = {"ok": "ok", "n/a": "-"}.get(v.split()[0], "noise" if _noise_only(v) else "FAIL")
        return word + (" (p)" if v.endswith(("(pending)", "PENDING)")) else "")
    lines = ["| case | " + " | ".join(forms) + " |", "|---" * (len(forms) + 1) + "|"]
    lines += [f"| {n} | " + " | ".join(cell(verdicts[n, f]) for f in forms) + " |" for n in names]
    return "\n".join(lines)


def _failure(exc: Exception) -> str:
    """A row's verdict for a failed run: the error's type and its first two lines."""
    return f"FAIL {type(exc).__name__}: {' | '.join(str(exc).strip().splitlines()[:2])[:300]}"


if __name__ == "__main__":
    main()
