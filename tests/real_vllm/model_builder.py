"""Build the lane's tiny random-weight Llama with the real Llama 3 tokenizer, offline.

Run by the engine venv's Python (it needs torch, transformers and tokenizers, which the
gateway's environment must not carry): ``VENV/bin/python model_builder.py OUT_DIR VOCAB SPECIALS_JSON
TEMPLATE``. No weights can be downloaded, so the weights are random (the lane tests caching and
tokenization, never the text); the tokenizer must be the real one, because block hashes follow
token ids: the ranks come from the vocabulary the gateway bundles (quicktok's ``llama3``, passed
as a tiktoken file), turned into a ``tokenizer.json`` by transformers' ``TikTokenConverter``, which
drops extra specials, so all 256 are added here at 128000-128255 with Llama 3.1's names (the
caller derives them from quicktok's list and checks the ids), passed as a JSON list in id order.
The chat template is Llama 3.1 Instruct's published Jinja, as the gateway's simulator bundles it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MODEL_CONFIG = {
    "vocab_size": 128256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "tie_word_embeddings": False,
}
# The pattern of Llama 3's tokenizer.json (tiktoken's cl100k-style split, as Meta publishes it).
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(out: Path, tiktoken_file: Path, names: list[str], template: str) -> None:
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(tiktoken_file), pattern=PATTERN).converted()
    assert tok.get_vocab_size() == 128000, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(n, normalized=False, special=True) for n in names])
    for i, name in enumerate(names):
        assert tok.token_to_id(name) == 128000 + i, (name, tok.token_to_id(name))
    # Llama 3's post-processor: BOS before a prompt tokenized with add_special_tokens (completions)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                special_tokens=[("<|begin_of_text|>", 128000)],
            ),
        ]
    )
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(128000 + i): {
            "content": n,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, n in enumerate(names)
    }
    config = {
        "added_tokens_decoder": added,
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, indent=2)
    )


def build_weights(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODEL_CONFIG, torch_dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    GenerationConfig(bos_token_id=128000, eos_token_id=[128001, 128008, 128009]).save_pretrained(str(out))


LORA_RANK = 8


def build_lora(out: Path) -> None:
    """A random LoRA adapter (PEFT layout) on q_proj/v_proj: vLLM serves it as a second model id.

    Its requests are cached apart from the base model's (the adapter's name is in each block's
    extra keys): what the recording's ``lora-*`` requests and their ``BlockStored`` events show.
    """
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1)
    hidden, heads = MODEL_CONFIG["hidden_size"], MODEL_CONFIG["num_key_value_heads"]
    tensors = {}
    for layer in range(MODEL_CONFIG["num_hidden_layers"]):
        for proj, width in (("q_proj", hidden), ("v_proj", heads * MODEL_CONFIG["head_dim"])):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(LORA_RANK, hidden) * 0.01).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(width, LORA_RANK) * 0.01).to(torch.bfloat16)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": LORA_RANK,
        "lora_alpha": 2 * LORA_RANK,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "meta-llama/Llama-3.1-8B-Instruct",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))


def main(argv: list[str]) -> int:
    out, tiktoken_file, specials_file, template_file = (Path(a) for a in argv[:4])
    out.mkdir(parents=True, exist_ok=True)
    names = json.loads(specials_file.read_text())
    if len(names) != 256:
        raise SystemExit(f"expected 256 special tokens, got {len(names)}")
    build_tokenizer(out, tiktoken_file, names, template_file.read_text())
    build_weights(out)
    build_lora(out / "lora")
    print(json.dumps({"model_dir": str(out), "specials": names}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
