"""Random chains of modules for runtime tests (seeded, small, CPU)."""

from __future__ import annotations

import torch
from torch import nn


def random_mlp_chain(seed: int, stages: int = 8, width: int = 96) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    choices = ["linear", "gelu", "dropout", "bn", "relu", "tanh", "block"]
    layers = [nn.Linear(width, width)]
    for _ in range(stages - 2):
        kind = choices[int(torch.randint(len(choices), (1,), generator=g))]
        layers.append(
            {
                "linear": lambda: nn.Linear(width, width),
                "gelu": nn.GELU,
                "dropout": lambda: nn.Dropout(0.3),
                "bn": lambda: nn.BatchNorm1d(width),
                "relu": nn.ReLU,
                "tanh": nn.Tanh,
                "block": lambda: nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(0.2), nn.Linear(2 * width, width)),
            }[kind]()
        )
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def conv_chain(channels: int = 8) -> nn.Sequential:
    def conv_block(c_in, c_out, stride=1):
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())

    return nn.Sequential(
        conv_block(3, channels),
        conv_block(channels, channels),
        nn.Dropout2d(0.2),
        conv_block(channels, 2 * channels, stride=2),
        nn.GELU(),
        conv_block(2 * channels, 2 * channels),
        nn.BatchNorm2d(2 * channels),
        nn.Conv2d(2 * channels, 2 * channels, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, 10),
    )


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm and a residual connection."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (
            nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
            if stride != 1 or c_in != c_out
            else nn.Identity()
        )

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class TinyResNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, 2), BasicBlock(2 * width, 2 * width))
        self.head = nn.Linear(2 * width, classes)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, labels=None):
        x = self.layer2(self.layer1(self.stem(x)))
        logits = self.head(self.drop(x.mean(dim=(2, 3))))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits, labels), logits


def tiny_gpt2(n_layer: int = 2, n_embd: int = 64, n_positions: int = 128, vocab_size: int = 256):
    """A randomly initialised Hugging Face GPT-2 (nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab_size, n_positions=n_positions,
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config).train()


def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def tiny_llama(n_layer: int = 2, hidden_size: int = 64):
    """A randomly initialised Llama-style model: GQA (4 query heads, 2 key/value heads), RMSNorm, SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    config = LlamaConfig(
        vocab_size=256, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).train()


def tiny_qwen2(n_layer: int = 2):
    """A randomly initialised Qwen2-style model (GQA, biased q/k/v projections, tied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _quiet_transformers()
    config = Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layer, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).train()


def tiny_bert(n_layer: int = 2):
    """A randomly initialised BERT for masked language modelling (dropout 0.1 as configured by default)."""
    from transformers import BertConfig, BertForMaskedLM

    _quiet_transformers()
    config = BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=n_layer, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128,
    )
    return BertForMaskedLM(config).train()


def tiny_vit(n_layer: int = 2):
    """A randomly initialised ViT image classifier (32x32 images, 8x8 patches, 10 classes)."""
    from transformers import ViTConfig, ViTForImageClassification

    _quiet_transformers()
    config = ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=n_layer, num_attention_heads=4,
        intermediate_size=128, num_labels=10,
    )
    return ViTForImageClassification(config).train()


class LossOnly(nn.Module):
    """A causal LM wrapped to return its loss only (what a training loop differentiates)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(ids, labels=labels, use_cache=False).loss


def padded_batch(length: int, batch: int = 2, pad: int = 0, seed: int = 0, vocab_size: int = 512) -> dict:
    """A dynamically padded language-model batch: the last row padded by ``pad`` tokens (mask 0, labels -100)."""
    g = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(0, vocab_size, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if pad:
        mask[-1, length - pad:] = 0
        labels[-1, length - pad:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (integer views: signed zeros and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def tiny_t5(layers: int = 3, d_model: int = 128, dropout: float = 0.1):
    """A randomly initialised T5 (``layers`` encoder and decoder layers, ``dropout``): every decoder
    layer reads the encoder's output, and the first layer of each stack makes the position bias
    the later ones read."""
    from transformers import T5Config, T5ForConditionalGeneration

    _quiet_transformers()
    config = T5Config(
        vocab_size=256, d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model, num_layers=layers,
        num_decoder_layers=layers, num_heads=4, decoder_start_token_id=0, pad_token_id=0, dropout_rate=dropout,
    )
    return T5ForConditionalGeneration(config).train()


def tiny_bart(layers: int = 2, d_model: int = 64):
    """A randomly initialised BART (``layers`` encoder and decoder layers, dropout 0.1)."""
    from transformers import BartConfig, BartForConditionalGeneration

    _quiet_transformers()
    config = BartConfig(
        vocab_size=256, d_model=d_model, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model,
        max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )
    return BartForConditionalGeneration(config).train()


def seq2seq_call(batch: int = 2, source: int = 64, target: int = 32, seed: int = 0) -> dict:
    """What a seq2seq data collator gives: input ids, an attention mask with padding, labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (batch, source), generator=generator)
    attention_mask = torch.ones_like(ids)
    attention_mask[-1, source * 3 // 4:] = 0
    labels = torch.randint(3, 256, (batch, target), generator=generator)
    return {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}


class UNetResBlock(nn.Module):
    """A diffusers-style residual block: GroupNorm, SiLU, 3x3 convolutions, a 1x1 shortcut where widths differ."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(4, c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x):
        h = self.conv1(nn.functional.silu(self.norm1(x)))
        h = self.conv2(nn.functional.silu(self.norm2(h)))
        return self.shortcut(x) + h


class UNetDown(nn.Module):
    """A residual block, then a strided convolution: returns (the downsampled map, the skip tensor)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.res = UNetResBlock(c_in, c_out)
        self.down = nn.Conv2d(c_out, c_out, 3, stride=2, padding=1)

    def forward(self, x):
        skip = self.res(x)
        return self.down(skip), skip


class UNetUp(nn.Module):
    """Upsample, concatenate the skip tensor of the same level, a residual block."""

    def __init__(self, c_in: int, c_skip: int, c_out: int):
        super().__init__()
        self.res = UNetResBlock(c_in + c_skip, c_out)

    def forward(self, x, skip):
        x = nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.res(torch.cat([x, skip], dim=1))


class TinyUNet(nn.Module):
    """A small UNet with long skip connections (diffusers-style, without time embedding), trained to
    denoise: ``model(noisy, target)`` returns the mean squared error."""

    def __init__(self, width: int = 16, levels: int = 3):
        super().__init__()
        widths = [width * 2 ** k for k in range(levels)]
        self.conv_in = nn.Conv2d(3, width, 3, padding=1)
        self.down_blocks = nn.ModuleList(UNetDown(c_in, c_out) for c_in, c_out in zip([width, *widths[:-1]], widths))
        self.mid = nn.ModuleList([UNetResBlock(widths[-1], widths[-1]), UNetResBlock(widths[-1], widths[-1])])
        ups = []
        c = widths[-1]
        for c_skip in reversed(widths):
            ups.append(UNetUp(c, c_skip, c_skip))
            c = c_skip
        self.up_blocks = nn.ModuleList(ups)
        self.norm_out = nn.GroupNorm(4, width)
        self.conv_out = nn.Conv2d(width, 3, 3, padding=1)

    def forward(self, noisy, target):
        h = self.conv_in(noisy)
        skips = []
        for down in self.down_blocks:
            h, skip = down(h)
            skips.append(skip)
        for block in self.mid:
            h = block(h)
        for up in self.up_blocks:
            h = up(h, skips.pop())
        out = self.conv_out(nn.functional.silu(self.norm_out(h)))
        return nn.functional.mse_loss(out, target)
