"""Shared test settings: a small CapsNet so that training tests run in seconds on 2 cores."""

from capsnet import CapsNetConfig

SMALL_MODEL = dict(conv_channels=16, primary_types=4, primary_dim=4, digit_dim=6, decoder_hidden=(32, 64))
SMALL_FLAGS = [
    "--conv-channels", "16", "--primary-types", "4", "--primary-dim", "4", "--digit-dim", "6",
    "--decoder-hidden", "32", "64",
]  # fmt: skip


def small_config(**overrides) -> CapsNetConfig:
    return CapsNetConfig(**{**SMALL_MODEL, **overrides})
