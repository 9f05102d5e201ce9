"""Errors the kernels raise on purpose. The engine turns them into its own at its boundary
(engine/loader.py), so kernels/ never imports engine/."""


class KernelUnavailableError(RuntimeError):
    """A kernel set this machine cannot build (a missing package or device feature)."""
