"""MXFP4 (OCP microscaling FP4) weights, as K3's checkpoint ships its routed experts.

Format (compressed-tensors `mxfp4-pack-quantized`, the per-expert layout vLLM loads):
- `<linear>.weight_packed` uint8 [out, in/2]: E2M1 codes, two per byte, the even element
  (index 2j) in the LOW nibble and 2j+1 in the high nibble. A code is sign (bit 3), exponent
  (bits 2-1, bias 1) and mantissa (bit 0): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
- `<linear>.weight_scale` uint8 [out, in/32]: one E8M0 scale per 32 consecutive inputs of a row,
  2^(s - 127); s = 255 is NaN.

The reference dequantizes at load (exactly: every MXFP4 value is representable in fp32 and
bf16). `quantize` follows the OCP MX rule: scale exponent floor(log2(amax)) - 2, elements
rounded to the nearest E2M1 value (ties to the even code), saturating at +-6; values that are
already MXFP4 round-trip exactly.
"""
from __future__ import annotations

import torch

GROUP = 32
E8M0_BIAS = 127
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
PACKED, SCALE = "weight_packed", "weight_scale"


def e2m1_table() -> torch.Tensor:
    """fp32 value of each of the 16 codes (codes 8..15 are the negatives of 0..7)."""
    mag = torch.tensor(E2M1_MAGNITUDES)
    return torch.cat([mag, -mag])


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 -> fp32 2^(s-127), built from the bits (exact; s = 0 is the subnormal
    2^-127, s = 255 NaN)."""
    s = scales.to(torch.int32)
    normal = (s << 23).view(torch.float32)
    out = torch.where(s == 0, torch.tensor(2.0 ** -127), normal)
    return torch.where(s == 255, torch.tensor(float("nan")), out)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] -> codes uint8 [..., n] (low nibble first)."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., n] (n even) -> uint8 [..., n/2], element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def dequantize(packed: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight_packed [..., K/2] and weight_scale [..., K/32] -> the weight [..., K]."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got {packed.dtype} and {scales.dtype}")
    k = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * GROUP != k:
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not fit packed values "
                         f"{tuple(packed.shape)} (one scale per {GROUP} values)")
    values = e2m1_table()[unpack_codes(packed).long()]
    groups = values.view(*values.shape[:-1], k // GROUP, GROUP)
    return (groups * e8m0_to_float(scales)[..., None]).view(values.shape).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [..., K] (K a multiple of 32) -> (weight_packed, weight_scale)."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}, "
                         f"got {w.shape[-1]}")
    x = w.detach().float().reshape(*w.shape[:-1], -1, GROUP)
    amax = x.abs().amax(-1)
    # floor(log2(amax)) from the float's exponent bits, exact (no log2 rounding)
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS
    exp = torch.where(amax > 0, exp - 2, torch.tensor(-E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scales = (exp + E8M0_BIAS).to(torch.uint8)
    scaled = x / e8m0_to_float(scales)[..., None]
    mag = torch.tensor(E2M1_MAGNITUDES)
    dist = (scaled.abs()[..., None] - mag).abs()
    code = dist.argmin(-1)                        # the lower code on a tie
    nxt = (code + 1).clamp(max=7)
    tie = (dist.gather(-1, nxt[..., None])[..., 0] == dist.gather(-1, code[..., None])[..., 0])
    code = torch.where(tie & (code % 2 == 1), nxt, code)   # ties to the even code
    code = code + 8 * torch.signbit(scaled)   # -0 stays code 8, so codes round-trip too
    codes = code.to(torch.uint8).view(*w.shape[:-1], -1)
    return pack_codes(codes), scales
