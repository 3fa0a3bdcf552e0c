"""The embedded default model: a tiny random hybrid Gated-DeltaNet LM of the Qwen3.5/3.6 family.

Built once, offline and seeded, into the user cache dir; `vx extract` with no `--model` uses it.
The architecture is the real one (`Qwen3_5ForCausalLM`, 3 GDN layers : 1 full-attention layer),
only small: GDN key/value head dims are 64 (vLLM's CPU GDN kernel accepts only 64 or 128),
weights are bf16. The tokenizer is a byte-level BPE trained here on a small embedded corpus,
with a Qwen-style chat template that marks assistant turns with `{% generation %}`.
Also here: the other random models vx builds (a Qwen3-Next twin and a VL-layout twin for tests,
and `small_random_twin`, the few-layer random copy of a user's target that `vx selftest` runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from vx.home import cache_dir

TINY_NAME = "tiny-qwen3_5-v1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A speculative decoding drafter learns from the
hidden states of a large target model. Write a short poem about the sea. Explain how a hash map
works, then give an example in Python: def add(a, b): return a + b. What is the capital of France?
Paris is the capital of France. Sure! Here is a step-by-step answer: first, second, third.
1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 user assistant system tool JSON {"key": "value"} [1, 2, 3]
Translate to German: good morning -> Guten Morgen. Summarise the following article in three
sentences. I'm sorry, but I can't help with that. Let's think about this carefully.
"""


def default_model_dir() -> Path:
    """The embedded default model's directory, built on first use."""
    path = cache_dir() / TINY_NAME
    if not (path / "config.json").exists():
        build_tiny_model(path)
    return path


def build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def tiny_text_config(tokenizer, num_layers: int = 8, hidden_size: int = 256):
    from transformers import Qwen3_5TextConfig

    vocab = ((len(tokenizer) + 63) // 64) * 64
    return Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)],
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="bfloat16",
    )


def build_tiny_model(path: Path, num_layers: int = 8, hidden_size: int = 256, seed: int = 0,
                     tokenizer_builder=None, vocab_size: int | None = None) -> Path:
    """Build the tiny random text-only model at `path` (atomically: temp dir, then rename).

    `tokenizer_builder(dir) -> tokenizer` swaps in another tokenizer (bench: the real Qwen3.6 one)."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    with _building(path) as tmp:
        tokenizer = (tokenizer_builder or build_tokenizer)(tmp)
        config = tiny_text_config(tokenizer, num_layers=num_layers, hidden_size=hidden_size)
        if vocab_size:
            config.vocab_size = vocab_size
        torch.manual_seed(seed)
        Qwen3_5ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    return Path(path)


def build_tiny_next(path: Path, num_layers: int = 4, hidden_size: int = 256, seed: int = 2) -> Path:
    """A tiny random Qwen3-Next (hybrid GDN + MoE) model, for tests of a second hybrid family.

    Its router sends every token to all 4 experts (weighted by the softmax): the MoE path runs,
    and the states stay a continuous function of the input. With top-2 of 4, bf16 rounding flips
    near-tie expert choices of this random router often enough that a short sample's cosine
    against the fp32 reference fell to 0.9939 in CI (thread-count dependent): the model's
    rounding, not capture error, and it made the test a coin toss."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    with _building(path) as tmp:
        tokenizer = build_tokenizer(tmp)
        base = tiny_text_config(tokenizer, num_layers=num_layers, hidden_size=hidden_size).to_dict()
        keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                "linear_num_value_heads", "layer_types", "max_position_embeddings", "tie_word_embeddings",
                "pad_token_id", "eos_token_id")
        config = Qwen3NextConfig(**{k: base[k] for k in keep}, intermediate_size=2 * hidden_size, num_experts=4,
                                 num_experts_per_tok=4, moe_intermediate_size=hidden_size,
                                 shared_expert_intermediate_size=hidden_size, decoder_sparse_step=1,
                                 norm_topk_prob=True, dtype="bfloat16")
        torch.manual_seed(seed)
        Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    return Path(path)


def build_tiny_llama(path: Path, num_layers: int = 6, hidden_size: int = 192, seed: int = 7) -> Path:
    """A tiny random Llama: every layer full attention (no Gated DeltaNet), for tests of the dense
    families, whose engine puts the cache-only capture layer in the attention layers' KV group."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with _building(path) as tmp:
        tokenizer = build_tokenizer(tmp)
        config = LlamaConfig(vocab_size=((len(tokenizer) + 63) // 64) * 64, hidden_size=hidden_size,
                             intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=hidden_size // 4, max_position_embeddings=8192,
                             tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=None, dtype="bfloat16")
        torch.manual_seed(seed)
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp)
    return Path(path)


def build_vl_twin(text_dir: Path, path: Path, seed: int = 1) -> Path:
    """Save `text_dir`'s model in the vision-language layout real Qwen3.5/3.6 checkpoints ship in.

    `Qwen3_5ForConditionalGeneration`, a `text_config` inside `config.json`, decoder weights under
    `model.language_model.*`, plus a small random vision tower under `model.visual.*`.
    The language weights are bit-identical to the text-only twin.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5TextConfig

    text_dir, path = Path(text_dir), Path(path)
    text_cfg = Qwen3_5TextConfig.from_pretrained(text_dir)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text_cfg.hidden_size,
                  num_position_embeddings=64)
    text = text_cfg.to_dict()
    for key in ("architectures", "transformers_version", "model_type"):
        text.pop(key, None)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=text_cfg.vocab_size - 1,
                           video_token_id=text_cfg.vocab_size - 2, vision_start_token_id=text_cfg.vocab_size - 3,
                           vision_end_token_id=text_cfg.vocab_size - 4, tie_word_embeddings=False)
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    config.dtype = "bfloat16"

    with _building(path) as tmp:
        weights = {}
        for f in sorted(text_dir.glob("*.safetensors")):
            for name, t in load_file(f).items():
                if name.startswith("model."):
                    weights["model.language_model." + name[len("model."):]] = t
                else:
                    weights[name] = t
        from transformers import Qwen3_5VisionModel

        torch.manual_seed(seed)
        visual = Qwen3_5VisionModel._from_config(config.vision_config).to(torch.bfloat16)
        for name, t in visual.state_dict().items():
            weights["model.visual." + name] = t.contiguous()
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(text_dir).save_pretrained(tmp)
    return path


def few_layers(text_config: dict) -> int:
    """Layers of the small model: enough to hold every layer type of the target (GDN and full
    attention for the hybrid families), and at least 4."""
    types = text_config.get("layer_types") or []
    need = len(set(types))
    seen: set = set()
    for i, t in enumerate(types):
        seen.add(t)
        if len(seen) == need:
            return max(4, i + 1)
    return min(4, int(text_config["num_hidden_layers"]))


def small_random_twin(src: Path) -> Path:
    """A small random model of a target's architecture (`vx selftest`): the target's own config
    (src: its checkpoint directory) with few_layers() layers, its real hidden size and vocabulary,
    random bf16 weights, its tokenizer files; built once into the vx cache."""
    import hashlib

    src = Path(src)
    raw = (src / "config.json").read_bytes()
    cfg = json.loads(raw)
    n = few_layers(cfg.get("text_config") or cfg)
    path = cache_dir() / "selftest" / f"twin-v1-{hashlib.sha256(raw).hexdigest()[:16]}-{n}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    text = config.get_text_config()
    text.num_hidden_layers = n
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:n]
    with _building(path) as tmp:
        for f in src.iterdir():  # the tokenizer and template files: vLLM loads the tokenizer
            if f.is_file() and f.name != "config.json" and not f.name.startswith("model") and \
                    f.suffix not in (".safetensors", ".bin", ".pt", ".pth"):
                shutil.copy2(f, tmp / f.name)
        torch.manual_seed(0)
        if getattr(config, "vision_config", None) is not None:
            from transformers import AutoModelForImageTextToText as Auto
        else:
            Auto = AutoModelForCausalLM
        Auto.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp)
    return path


@contextlib.contextmanager
def _building(path: Path):
    """Build into a temp dir beside `path`, then rename it into place (atomic). If another process
    won the race, keep theirs; on error nothing is left behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    from transformers.utils import logging as hf_logging

    quiet = hf_logging.is_progress_bar_enabled()
    if quiet:  # a sub-second save: no "Writing model shards" bar on the first run's stderr
        hf_logging.disable_progress_bar()
    try:
        yield tmp
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").exists():
                raise
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps({"model": str(default_model_dir())}))
