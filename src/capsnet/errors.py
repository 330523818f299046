"""Exceptions that the CLI turns into one clear line and a non-zero exit."""

from __future__ import annotations


class CapsNetError(Exception):
    """Base class of every error capsnet raises on purpose (bad input, bad files)."""


class DatasetError(CapsNetError):
    """A data set is missing, truncated, corrupt or inconsistent."""


class DownloadError(CapsNetError):
    """A download failed on every try (:func:`capsnet.fetch.fetch_url`). `url` is what was fetched; `permanent`
    says that asking this URL again cannot help (HTTP 404, an unknown host), as opposed to running out of tries."""

    def __init__(self, message: str, *, url: str = "", permanent: bool = False):
        super().__init__(message)
        self.url, self.permanent = url, permanent


class CheckpointError(CapsNetError):
    """A checkpoint or pretrained folder is missing, corrupt or does not match its config."""


class ConfigError(CapsNetError, ValueError):
    """A configuration value or file is invalid."""


class RunFolderError(ConfigError):
    """A run folder cannot be trained into: another process holds it, it is not a capsnet run, it holds a run of
    other settings, or it holds nothing to resume."""


class ExportError(CapsNetError):
    """A model cannot be exported (to ONNX or torch.export), or its exported file does not match it."""


class KernelBuildError(CapsNetError, RuntimeError):
    """A C++ routing kernel asked for (``capsnet build-kernels``, the "cpp" backend) does not build here: no
    compiler, no ninja, or a compiler error."""
