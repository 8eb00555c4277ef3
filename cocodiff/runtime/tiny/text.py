"""The tiny models' text side: tokenizers made offline from an in-code word list, and
one-layer text encoders.

Tokenizers are the real transformers classes (CLIPTokenizer, T5Tokenizer, Qwen2Tokenizer) fed a
vocabulary made here from an in-code word list: byte-level BPE (all 256 bytes plus merges that
make each listed word one token) for CLIP and Qwen2, a unigram vocabulary of whole words and
single characters for T5. Every prompt is accepted (bytes, or the unknown token for T5).
"""


from __future__ import annotations

import re
from itertools import pairwise
from typing import TypeVar

from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5Tokenizer,
)

from cocodiff.models.families import TINY_TEXT_TOKENS

_BPETokenizer = TypeVar("_BPETokenizer", CLIPTokenizer, Qwen2Tokenizer)

NUM_HEADS = 4
CLIP_MAX_TOKENS = 16
TEXT_MAX_TOKENS = TINY_TEXT_TOKENS

# Words the tokenizers know as whole tokens; anything else falls back to bytes or characters.
_WORDS = (
    "a an the of in on at by with and or under over near behind above below beside from to into "
    "is are it this that its his her their my your our photo picture painting drawing render "
    "image portrait landscape closeup close up view scene style art digital oil watercolor sketch "
    "cat dog bird horse fish lion tiger bear fox wolf rabbit mouse owl dragon robot astronaut "
    "man woman child person people girl boy king queen knight wizard city street road bridge "
    "house castle tower church room kitchen garden park forest tree trees flower flowers grass "
    "mountain mountains hill river lake sea ocean beach island desert snow rain cloud clouds sky "
    "sun moon star stars night day morning evening sunset sunrise light shadow fire water ice "
    "red orange yellow green blue purple pink brown black white gray grey golden silver dark "
    "bright small big large tiny huge old new young beautiful cute happy sad colorful detailed "
    "realistic high quality sharp soft blurry cinematic dramatic epic fantasy futuristic vintage "
    "car train boat ship plane bicycle book table chair cup bottle hat window door wall floor "
    "sitting standing running flying walking riding holding wearing eating playing looking "
    "one two three four five many some lot lots very cool warm hot cold"
).split()

# The Qwen-Image prompt template: its system prefix must tokenize into exactly
# QwenImagePipeline.prompt_template_encode_start_idx (34) tokens, as with the real tokenizer,
# so that the pipeline drops the system prompt and keeps the user prompt.
_QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity,"
    " text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)



# ---------------------------------------------------------------------------------------------
# Tokenizers


def _apply_merges(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Applies BPE merges as ``tokenizers`` does: lowest rank first, leftmost on ties."""
    parts = list(symbols)
    while len(parts) > 1:
        ranked = [(ranks[pair], i) for i, pair in enumerate(pairwise(parts)) if pair in ranks]
        if not ranked:
            break
        _, i = min(ranked)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def _whole_word_bpe(
    tokenizer_cls: type[_BPETokenizer],
    segments: list[str],
    special_tokens: list[str],
    end_of_word_suffix: str = "",
    **kwargs: object,
) -> _BPETokenizer:
    """Builds a byte-level BPE tokenizer in which every word of ``segments`` is one token.

    The vocabulary is the special tokens, the 256 byte symbols (and their word-final forms when
    the class marks word ends with a suffix, as CLIP does), then one merge at a time: for each
    word, while the merges so far leave it in several pieces, merge its first two pieces. A new
    merge ranks last, so words already whole stay whole. Pure Python on a fixed word order: the
    same tokenizer in every process (unlike ``tokenizers``' trainer, whose ids for word-final
    symbols follow hash-map order).

    Args:
        tokenizer_cls: CLIPTokenizer or Qwen2Tokenizer (they take ``vocab=`` and ``merges=``).
        segments: texts whose words become tokens; special tokens must not occur in them.
        special_tokens: tokens placed first in the vocabulary.
        end_of_word_suffix: the suffix the class's BPE model appends to a word's last symbol.
        **kwargs: passed to ``tokenizer_cls``.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = [*special_tokens, *alphabet]
    if end_of_word_suffix:
        base += [symbol + end_of_word_suffix for symbol in alphabet]
    # Split words exactly as the real class does (normalizer, then its pre-tokenizer).
    backend = tokenizer_cls(vocab={t: i for i, t in enumerate(base)}, merges=[]).backend_tokenizer
    ranks: dict[tuple[str, str], int] = {}
    for segment in segments:
        text = backend.normalizer.normalize_str(segment) if backend.normalizer else segment
        for word, _ in backend.pre_tokenizer.pre_tokenize_str(text):
            symbols = list(word)
            symbols[-1] += end_of_word_suffix
            while len(parts := _apply_merges(symbols, ranks)) > 1:
                ranks[(parts[0], parts[1])] = len(ranks)
    tokens = dict.fromkeys([*base, *(left + right for left, right in ranks)])
    vocab = {token: i for i, token in enumerate(tokens)}
    return tokenizer_cls(vocab=vocab, merges=list(ranks), **kwargs)


def tiny_clip_tokenizer() -> CLIPTokenizer:
    """A CLIP tokenizer (byte-level BPE) that knows the in-code word list as whole words."""
    return _whole_word_bpe(
        CLIPTokenizer,
        [" ".join(_WORDS)],
        ["<|startoftext|>", "<|endoftext|>"],
        end_of_word_suffix="</w>",
        model_max_length=CLIP_MAX_TOKENS,
    )


def tiny_t5_tokenizer() -> T5Tokenizer:
    """A T5 unigram tokenizer: whole words from the word list, then single characters."""
    chars = sorted({c for w in _WORDS for c in w} | set("abcdefghijklmnopqrstuvwxyz0123456789"))
    chars += list("ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?'\"()-_/&%$#@*+=<>[]{}")
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    vocab += [("▁" + w, -5.0) for w in _WORDS]
    vocab += [(c, -8.0) for c in dict.fromkeys(chars)]
    vocab += [("▁" + c, -8.5) for c in dict.fromkeys(chars)]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def tiny_qwen_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 tokenizer (byte-level BPE) that knows the Qwen-Image template and the word list."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    template = _QWEN_TEMPLATE.format(" ".join(_WORDS))
    # Special tokens are cut out before pre-tokenization; each word also after a space ("Ġcat").
    segments = [*re.split(r"<\|im_start\|>|<\|im_end\|>", template), " " + " ".join(_WORDS)]
    tokenizer = _whole_word_bpe(Qwen2Tokenizer, segments, specials[:1], model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Text encoders


def _clip_text_config(tokenizer: CLIPTokenizer, hidden_size: int) -> CLIPTextConfig:
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=hidden_size,
        num_hidden_layers=1,
        num_attention_heads=NUM_HEADS,
        max_position_embeddings=CLIP_MAX_TOKENS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _t5_config(tokenizer: T5Tokenizer, d_model: int, cls: type[T5Config] = T5Config) -> T5Config:
    return cls(
        vocab_size=len(tokenizer),
        d_model=d_model,
        d_kv=d_model // NUM_HEADS,
        d_ff=2 * d_model,
        num_layers=1,
        num_heads=NUM_HEADS,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )


def _qwen_text_encoder(tokenizer: Qwen2Tokenizer, hidden_size: int):
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": 1,
            "num_attention_heads": NUM_HEADS,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            # Multimodal RoPE over (time, height, width): sections sum to head_dim / 2.
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": [2, 1, 1],
                "rope_theta": 1_000_000.0,
            },
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [0],
        },
        # Vision token ids live past the text vocabulary: the text path never meets them.
        image_token_id=len(tokenizer) + 0,
        video_token_id=len(tokenizer) + 1,
        vision_start_token_id=len(tokenizer) + 2,
        vision_end_token_id=len(tokenizer) + 3,
    )
    return Qwen2_5_VLForConditionalGeneration(config)
