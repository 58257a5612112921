"""zerokv: lower torch.export'ed decoders to ExecuTorch GPU delegates that update the KV cache in place."""

from zerokv.errors import ZeroKVError

__all__ = ["ZeroKVError"]
