//! Element types and the bit-exact conversions shared by every backend.
//!
//! The functions here are the CPU twins of `shaders/numeric.wgsl` (and of the CUDA
//! kernels): the same integer algorithm, so that the reference, the oracle and the
//! generator agree bit for bit. Tests compare them against the `half` crate.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the upper half of a binary32).
    Bf16,
    /// Unsigned 32-bit integers: the routing tables of the MoE family (expert ids, row
    /// offsets, permutations). No arithmetic op reads them as numbers, and no case may
    /// name them as its input or output type.
    U32,
}

impl DType {
    /// Every floating-point element type (the types of tensors ops compute with).
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::Bf16];

    /// Size of one element in memory, in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::Bf16 => 2,
        }
    }

    /// Whether the type is a floating-point one (every type but [`DType::U32`]).
    pub fn is_float(self) -> bool {
        self != DType::U32
    }

    /// Lower-case name as used in case files.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::U32 => "u32",
        }
    }

    /// Unit roundoff (half an ulp at 1.0).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => f32::EPSILON as f64 / 2.0,
            DType::F16 => 2f64.powi(-11),
            DType::Bf16 => 2f64.powi(-8),
            DType::U32 => 0.0,
        }
    }

    /// Rounds an f32 to this type (round to nearest even) and returns its bit pattern,
    /// zero-extended to 32 bits.
    pub fn encode(self, x: f32) -> u32 {
        match self {
            DType::F32 => x.to_bits(),
            DType::F16 => f32_to_f16_bits(x),
            DType::Bf16 => f32_to_bf16_bits(x),
            // Integers below 2^24 round-trip through f32 exactly; larger values saturate
            // (u32::MAX, the tables' "none", decodes to 2^32 and encodes back to itself).
            DType::U32 => x as u32,
        }
    }

    /// Widens a bit pattern of this type (as produced by [`DType::encode`]) to f32; exact.
    pub fn decode(self, bits: u32) -> f32 {
        match self {
            DType::F32 => f32::from_bits(bits),
            DType::F16 => f16_bits_to_f32(bits),
            DType::Bf16 => f32::from_bits(bits << 16),
            DType::U32 => bits as f32,
        }
    }

    /// The poison pattern written into every non-input buffer before a run: a quiet NaN
    /// with a recognisable payload, so that a read of memory no op wrote turns results
    /// into NaN and shows up in the output check.
    pub fn poison_bits(self) -> u32 {
        match self {
            DType::F32 => 0x7fc0_dead,
            DType::F16 => 0x7e5a,
            DType::Bf16 => 0x7fa5,
            // Far beyond any table's row count, so a read of an unwritten table entry
            // selects no row.
            DType::U32 => 0xdead_beef,
        }
    }

    /// Rounds an f32 to the nearest value representable in this type.
    pub fn round(self, x: f32) -> f32 {
        self.decode(self.encode(x))
    }

    /// Appends `bits` (one element) to `out` in this type's little-endian memory layout.
    pub fn push_le_bytes(self, bits: u32, out: &mut Vec<u8>) {
        match self {
            DType::F32 | DType::U32 => out.extend_from_slice(&bits.to_le_bytes()),
            DType::F16 | DType::Bf16 => out.extend_from_slice(&(bits as u16).to_le_bytes()),
        }
    }

    /// `words` (one element each) in this type's little-endian memory layout.
    pub fn le_bytes(self, words: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(words.len() * self.size_bytes());
        for &w in words {
            self.push_le_bytes(w, &mut out);
        }
        out
    }

    /// The first `count` elements of a little-endian byte slice in this type's layout.
    pub fn words_from_le(self, bytes: &[u8], count: usize) -> Vec<u32> {
        (0..count).map(|e| self.read_le_bits(bytes, e)).collect()
    }

    /// Reads element `index` of a little-endian byte slice in this type's layout.
    pub fn read_le_bits(self, bytes: &[u8], index: usize) -> u32 {
        let n = self.size_bytes();
        let b = &bytes[index * n..index * n + n];
        match self {
            DType::F32 | DType::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            DType::F16 | DType::Bf16 => u16::from_le_bytes([b[0], b[1]]) as u32,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(DType::F32),
            "f16" => Ok(DType::F16),
            "bf16" => Ok(DType::Bf16),
            other => Err(format!("unknown dtype `{other}` (expected f32, f16 or bf16)")),
        }
    }
}

/// f32 -> binary16 bits, round to nearest even. Twin of `f32_to_f16_bits` in numeric.wgsl.
pub fn f32_to_f16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    let sign = (b >> 16) & 0x8000;
    let exp = ((b >> 23) & 0xff) as i32;
    let mant = b & 0x7f_ffff;
    if exp == 255 {
        // Inf stays inf; NaN stays a quiet NaN with the top payload bits.
        return if mant == 0 { sign | 0x7c00 } else { sign | 0x7e00 | (mant >> 13) };
    }
    let e = exp - 127 + 15;
    if e >= 31 {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = mant | 0x80_0000;
        let shift = (14 - e) as u32;
        let q = m >> shift;
        let rem = m & ((1u32 << shift) - 1);
        let halfway = 1u32 << (shift - 1);
        let up = rem > halfway || (rem == halfway && (q & 1) == 1);
        return sign | (q + up as u32);
    }
    let h = sign | ((e as u32) << 10) | (mant >> 13);
    let rem = mant & 0x1fff;
    let up = rem > 0x1000 || (rem == 0x1000 && (h & 1) == 1);
    // A carry out of the mantissa correctly bumps the exponent (up to inf).
    h + up as u32
}

/// binary16 bits -> f32, exact. Twin of `f16_bits_to_f32` in numeric.wgsl.
pub fn f16_bits_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let mant = h & 0x3ff;
    if exp == 0 {
        // Zero or subnormal: mant * 2^-24 is an exact f32 normal (or zero).
        let v = mant as f32 * f32::from_bits(0x3380_0000); // 2^-24
        return f32::from_bits(sign | v.to_bits());
    }
    if exp == 31 {
        return f32::from_bits(sign | 0x7f80_0000 | (mant << 13));
    }
    f32::from_bits(sign | ((exp + 112) << 23) | (mant << 13))
}

/// f32 -> bfloat16 bits, round to nearest even. Twin of `f32_to_bf16_bits` in numeric.wgsl.
pub fn f32_to_bf16_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if (b & 0x7fff_ffff) > 0x7f80_0000 {
        return (b >> 16) | 0x40;
    }
    let lsb = (b >> 16) & 1;
    (b.wrapping_add(0x7fff + lsb)) >> 16
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe_values() -> Vec<f32> {
        let mut v = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65520.0,
            -65520.0,
            1e-8,
            5.96e-8,
            2.98e-8,
            6.1e-5,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
        ];
        // A deterministic sweep of bit patterns, dense around the f16 range.
        let mut x: u32 = 0x1234_5678;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let f = f32::from_bits(x);
            if f.is_finite() {
                v.push(f);
                v.push(f * 1e-30);
                v.push((f.abs() % 70000.0).copysign(f));
            }
        }
        v
    }

    #[test]
    fn f16_rounding_matches_half_crate() {
        for x in probe_values() {
            let ours = f32_to_f16_bits(x);
            let theirs = half::f16::from_f32(x).to_bits() as u32;
            assert_eq!(ours, theirs, "f32 {x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn bf16_rounding_matches_half_crate() {
        for x in probe_values() {
            let ours = f32_to_bf16_bits(x);
            let theirs = half::bf16::from_f32(x).to_bits() as u32;
            assert_eq!(ours, theirs, "f32 {x:e} ({:#010x})", x.to_bits());
        }
    }

    #[test]
    fn f16_widening_is_exact_for_every_pattern() {
        for h in 0u32..=0xffff {
            let ours = f16_bits_to_f32(h);
            let theirs = half::f16::from_bits(h as u16).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn round_trip_through_bytes() {
        for dt in DType::ALL {
            let bits = dt.encode(-1.5);
            let mut bytes = Vec::new();
            dt.push_le_bytes(bits, &mut bytes);
            assert_eq!(bytes.len(), dt.size_bytes());
            assert_eq!(dt.decode(dt.read_le_bits(&bytes, 0)), -1.5);
        }
    }
}
