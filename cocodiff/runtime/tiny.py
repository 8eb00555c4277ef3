"""Built-in tiny diffusers pipelines with random weights, built offline from configs
(and ``tiny-digits``, whose trained weights ship with the package: :mod:`cocodiff.runtime.digits`).

Nothing here touches the network: every component (transformer, VAE, text encoders, tokenizers,
scheduler) is constructed from an in-code config, and every weight comes from a fixed seed, so
two builds in two processes (two Ulysses ranks) hold bit-identical weights.

The shapes keep the real models' structure (joint or cross attention, RoPE layout, VAE
compression, latent channels) at toy sizes: 4 attention heads everywhere, so 1, 2 and 4 Ulysses
ranks split heads evenly, and default resolutions whose image-token counts divide by 4.

Tokenizers are the real transformers classes (CLIPTokenizer, T5Tokenizer, Qwen2Tokenizer) fed a
vocabulary made here from an in-code word list: byte-level BPE (all 256 bytes plus merges that
make each listed word one token) for CLIP and Qwen2, a unigram vocabulary of whole words and
single characters for T5. Every prompt is accepted (bytes, or the unknown token for T5).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import TypeVar

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    PixArtSigmaPipeline,
    PixArtTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from tokenizers import pre_tokenizers
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
    UMT5Config,
    UMT5EncoderModel,
)

_BPETokenizer = TypeVar("_BPETokenizer", CLIPTokenizer, Qwen2Tokenizer)

SEED = 0
NUM_HEADS = 4
HEAD_DIM = 16
INNER_DIM = NUM_HEADS * HEAD_DIM  # 64
# Text lengths are small so that the joint (text + image) sequence stays short and divisible by 4.
CLIP_MAX_TOKENS = 16
TEXT_MAX_TOKENS = 16

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


# What `cocodiff run` asks for when no --prompt is given (tiny-digits: a digit).
DEFAULT_PROMPT = "a lighthouse on a cliff at dawn"


@dataclass(frozen=True, slots=True)
class TinyDefaults:
    """Default generation settings of a tiny model.

    Attributes:
        width: image width in pixels.
        height: image height in pixels.
        frames: number of video frames (1 for image models).
        max_sequence_length: text tokens the pipeline pads / truncates the prompt to.
        prompt: the prompt used when none is given.
        vae_scale: image pixels per latent pixel, per side (the simulator's spec needs it:
            tiny-digits' VAE downsamples 4x, where every other family's does 8x).
    """

    width: int
    height: int
    frames: int
    max_sequence_length: int
    prompt: str = DEFAULT_PROMPT
    vae_scale: int = 8


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


# ---------------------------------------------------------------------------------------------
# VAEs


def _autoencoder_kl(latent_channels: int, **config) -> AutoencoderKL:
    """An 8x-downsampling AutoencoderKL with 8-channel blocks."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=128,
        **config,
    )


# ---------------------------------------------------------------------------------------------
# Pipelines


def _seeded(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Builds a module from a fresh generator state, leaving the caller's RNG untouched.

    Each component is seeded on its own so that changing one config does not change the
    weights of the others.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return build().eval()


def _flow_match_scheduler(**config) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, **config)


def build_flux() -> FluxPipeline:
    """FLUX.1-dev-shaped: 1 double + 1 single block, guidance-distilled, CLIP + T5 text."""
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = _seeded(
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,  # 16 latent channels packed 2x2
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=NUM_HEADS,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),
        )
    )
    return FluxPipeline(
        scheduler=_flow_match_scheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
        vae=_seeded(
            lambda: _autoencoder_kl(
                16,
                use_quant_conv=False,
                use_post_quant_conv=False,
                scaling_factor=0.3611,
                shift_factor=0.1159,
            )
        ),
        text_encoder=_seeded(lambda: CLIPTextModel(_clip_text_config(clip_tokenizer, 32))),
        tokenizer=clip_tokenizer,
        text_encoder_2=_seeded(lambda: T5EncoderModel(_t5_config(t5_tokenizer, 32))),
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )


def build_sd3() -> StableDiffusion3Pipeline:
    """SD3.5-shaped: 1 joint block with RMSNorm on Q/K, two CLIPs + T5 text."""
    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = _seeded(
        lambda: SD3Transformer2DModel(
            sample_size=16,
            patch_size=2,
            in_channels=16,
            num_layers=1,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=NUM_HEADS,
            joint_attention_dim=64,  # T5 width; CLIP states (2 x 32) are zero-padded to it
            caption_projection_dim=INNER_DIM,
            pooled_projection_dim=64,  # the two CLIP projections (32 + 32) concatenated
            out_channels=16,
            pos_embed_max_size=32,
            qk_norm="rms_norm",
        )
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=_flow_match_scheduler(shift=3.0),
        vae=_seeded(
            lambda: _autoencoder_kl(
                16,
                use_quant_conv=False,
                use_post_quant_conv=False,
                scaling_factor=1.5305,
                shift_factor=0.0609,
            )
        ),
        text_encoder=_seeded(
            lambda: CLIPTextModelWithProjection(_clip_text_config(clip_tokenizer, 32))
        ),
        tokenizer=clip_tokenizer,
        text_encoder_2=_seeded(
            lambda: CLIPTextModelWithProjection(_clip_text_config(clip_tokenizer, 32))
        ),
        tokenizer_2=tiny_clip_tokenizer(),
        text_encoder_3=_seeded(lambda: T5EncoderModel(_t5_config(t5_tokenizer, 64))),
        tokenizer_3=t5_tokenizer,
    )


def build_qwen() -> QwenImagePipeline:
    """Qwen-Image-shaped: 1 double-stream block, Qwen2.5-VL text encoder, 3D-causal VAE."""
    tokenizer = tiny_qwen_tokenizer()
    transformer = _seeded(
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,  # 16 latent channels packed 2x2
            out_channels=16,
            num_layers=1,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=NUM_HEADS,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        )
    )
    return QwenImagePipeline(
        scheduler=_flow_match_scheduler(
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
        ),
        vae=_seeded(
            lambda: AutoencoderKLQwenImage(
                base_dim=8,
                z_dim=16,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            )
        ),
        text_encoder=_seeded(lambda: _qwen_text_encoder(tokenizer, 32)),
        tokenizer=tokenizer,
        transformer=transformer,
    )


def build_wan() -> WanPipeline:
    """Wan2.1-T2V-shaped: 1 block (self-attention with 3D RoPE + cross-attention), UMT5 text."""
    tokenizer = tiny_t5_tokenizer()
    transformer = _seeded(
        lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=NUM_HEADS,
            attention_head_dim=HEAD_DIM,  # RoPE: 8 dims for time, 4 each for height and width
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=2 * INNER_DIM,
            num_layers=1,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=64,
        )
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(lambda: UMT5EncoderModel(_t5_config(tokenizer, 32, UMT5Config))),
        vae=_seeded(
            lambda: AutoencoderKLWan(
                base_dim=8,
                z_dim=16,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            )
        ),
        scheduler=_flow_match_scheduler(shift=3.0),
        transformer=transformer,
    )


def pixart_scheduler() -> DPMSolverMultistepScheduler:
    """PixArt-Sigma's own scheduler (DPM-Solver++ on a linear beta schedule, epsilon
    prediction), for every tiny PixArt pipeline."""
    return DPMSolverMultistepScheduler(beta_schedule="linear", beta_start=0.0001,
                                       beta_end=0.02, num_train_timesteps=1000,
                                       prediction_type="epsilon", solver_order=2)


def build_pixart() -> PixArtSigmaPipeline:
    """PixArt-Sigma-shaped: 1 block (self-attention + cross-attention to T5), SD VAE."""
    tokenizer = tiny_t5_tokenizer()
    transformer = _seeded(
        lambda: PixArtTransformer2DModel(
            num_attention_heads=NUM_HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            out_channels=8,  # learned sigma: the pipeline keeps the first 4 channels
            num_layers=1,
            cross_attention_dim=INNER_DIM,
            sample_size=16,
            patch_size=2,
            caption_channels=32,
            interpolation_scale=1,
        )
    )
    return PixArtSigmaPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(lambda: T5EncoderModel(_t5_config(tokenizer, 32))),
        vae=_seeded(lambda: _autoencoder_kl(4, scaling_factor=0.13025)),
        transformer=transformer,
        scheduler=pixart_scheduler(),
    )


def build_digits() -> PixArtSigmaPipeline:
    """PixArt-Sigma-shaped, trained on 8x8 digits: the weights that ship with the package."""
    # Imported here: cocodiff.runtime.digits builds on this module's tokenizer and T5 config.
    from cocodiff.runtime.digits import build_digits as build_trained

    return build_trained()


TINY_MODELS: dict[str, Callable[[], DiffusionPipeline]] = {
    "tiny-flux": build_flux,
    "tiny-sd3": build_sd3,
    "tiny-qwen": build_qwen,
    "tiny-wan": build_wan,
    "tiny-pixart": build_pixart,
    "tiny-digits": build_digits,
}

# Image models: 128 x 128 pixels -> 16 x 16 latents -> 8 x 8 = 64 image tokens (16 px per token).
# Wan: 5 frames -> 2 latent frames; 64 x 64 -> 8 x 8 latents -> 2 x 4 x 4 = 32 video tokens.
TINY_DEFAULTS: dict[str, TinyDefaults] = {
    "tiny-flux": TinyDefaults(128, 128, 1, TEXT_MAX_TOKENS),
    "tiny-sd3": TinyDefaults(128, 128, 1, TEXT_MAX_TOKENS),
    "tiny-qwen": TinyDefaults(128, 128, 1, TEXT_MAX_TOKENS),
    "tiny-wan": TinyDefaults(64, 64, 5, TEXT_MAX_TOKENS),
    "tiny-pixart": TinyDefaults(128, 128, 1, TEXT_MAX_TOKENS),
    # 32 x 32 pixels -> 8 x 8 latents -> 64 image tokens (patch size 1).
    "tiny-digits": TinyDefaults(32, 32, 1, TEXT_MAX_TOKENS, prompt="3", vae_scale=4),
}


def _check_name(name: str) -> None:
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(TINY_MODELS)}")


def build_tiny(name: str, dtype: torch.dtype = torch.float32) -> DiffusionPipeline:
    """Builds a tiny pipeline with deterministic random weights.

    Args:
        name: a key of ``TINY_MODELS``.
        dtype: dtype of the pipeline's modules: built in float32, then cast the way
            ``from_pretrained(dtype=...)`` casts (modules a class keeps in float32 stay so).

    Returns:
        The pipeline on CPU, modules in eval mode, progress bars off.

    Raises:
        ValueError: ``name`` is not a tiny model.
    """
    _check_name(name)
    pipe = TINY_MODELS[name]()
    pipe.set_progress_bar_config(disable=True)
    if dtype != torch.float32:
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                _cast_as_from_pretrained(component, dtype)
    return pipe


def _cast_as_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Casts floating-point weights to ``dtype``, except the modules the class keeps in float32.

    diffusers keeps ``_keep_in_fp32_modules`` (Wan: rope, time embedder, norms) in float32 for any
    lower dtype; transformers does so only for float16, and ``_keep_in_fp32_modules_strict`` for
    float16 and bfloat16. A weight is kept when one component of its dotted name is listed.
    """
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    if isinstance(model, PreTrainedModel):
        keep = keep if dtype == torch.float16 else set()
        keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    for module_name, module in model.named_modules():
        module_keys = set(module_name.split("."))
        for name, param in module.named_parameters(recurse=False):
            if param.is_floating_point() and not keep & (module_keys | {name}):
                param.data = param.data.to(dtype)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and not keep & (module_keys | {name}):
                setattr(module, name, buffer.to(dtype))


def default_resolution(name: str) -> tuple[int, int, int]:
    """Returns (width, height, frames) of a tiny model; image-token counts divide by 4."""
    _check_name(name)
    d = TINY_DEFAULTS[name]
    return d.width, d.height, d.frames
