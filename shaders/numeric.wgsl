// Shared numeric helpers, prepended to every stage. CPU twins: cmm-core `dtype.rs`
// and `generator.rs`. Every element lives in one 32-bit word of the heap: f32 bits,
// or f16/bf16 bits in the low half. Dtype codes: 0 = f32, 1 = f16, 2 = bf16.

fn f16_bits_to_f32(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = (h >> 10u) & 0x1fu;
    let mant = h & 0x3ffu;
    if (e == 0u) {
        let v = f32(mant) * bitcast<f32>(0x33800000u); // mant * 2^-24, exact
        return bitcast<f32>(sign | bitcast<u32>(v));
    }
    if (e == 31u) {
        return bitcast<f32>(sign | 0x7f800000u | (mant << 13u));
    }
    return bitcast<f32>(sign | ((e + 112u) << 23u) | (mant << 13u));
}

fn f32_to_f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let ex = i32((b >> 23u) & 0xffu);
    let mant = b & 0x7fffffu;
    if (ex == 255) {
        if (mant == 0u) {
            return sign | 0x7c00u;
        }
        return sign | 0x7e00u | (mant >> 13u);
    }
    let e = ex - 127 + 15;
    if (e >= 31) {
        return sign | 0x7c00u;
    }
    if (e <= 0) {
        if (e < -10) {
            return sign;
        }
        let m = mant | 0x800000u;
        let shift = u32(14 - e);
        let q = m >> shift;
        let rem = m & ((1u << shift) - 1u);
        let halfway = 1u << (shift - 1u);
        var up = 0u;
        if (rem > halfway || (rem == halfway && (q & 1u) == 1u)) {
            up = 1u;
        }
        return sign | (q + up);
    }
    let h = sign | (u32(e) << 10u) | (mant >> 13u);
    let rem = mant & 0x1fffu;
    var up = 0u;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) == 1u)) {
        up = 1u;
    }
    return h + up;
}

fn f32_to_bf16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;
    }
    let lsb = (b >> 16u) & 1u;
    return (b + 0x7fffu + lsb) >> 16u;
}

fn decode(bits: u32, dtype: u32) -> f32 {
    if (dtype == 1u) {
        return f16_bits_to_f32(bits);
    }
    if (dtype == 2u) {
        return bitcast<f32>(bits << 16u);
    }
    return bitcast<f32>(bits);
}

fn encode(x: f32, dtype: u32) -> u32 {
    if (dtype == 1u) {
        return f32_to_f16_bits(x);
    }
    if (dtype == 2u) {
        return f32_to_bf16_bits(x);
    }
    return bitcast<u32>(x);
}

// exp and ln from +, −, ×, ÷ and bit operations only, each correctly rounded on every
// adapter: the same bits as the CPU twin's `cmm_core::numeric::{exp_f32, ln_f32}`,
// operation for operation (WGSL's own exp and log are within a few ULP and differ
// between drivers). Results below the smallest normal f32 are 0 (exp) or −∞ (ln of
// such an argument), since some adapters flush subnormals. Constants are exact f32s.
const EXP_LOG2E: f32 = 0x1.715476p+0f;
const EXP_LN2_HI: f32 = 0x1.63p-1f;
const EXP_LN2_LO: f32 = -0x1.bd0106p-13f;
const EXP_LOW: f32 = -87.0;
const EXP_HIGH: f32 = 0x1.62e42ep+6f;
const LN_SQRT2: f32 = 0x1.6a09e6p+0f;

fn exp_cmm(x: f32) -> f32 {
    if (x > EXP_HIGH) {
        return bitcast<f32>(0x7f800000u);
    }
    if (x < EXP_LOW) {
        return 0.0;
    }
    let n = floor(x * EXP_LOG2E + 0.5);
    let r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;
    var p = 0x1.a01a02p-13f; // 1/5040
    p = p * r + 0x1.6c16c2p-10f; // 1/720
    p = p * r + 0x1.111112p-7f; // 1/120
    p = p * r + 0x1.555556p-5f; // 1/24
    p = p * r + 0x1.555556p-3f; // 1/6
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let k = i32(n);
    if (k > 127) {
        return (p * 2.0) * bitcast<f32>(254u << 23u);
    }
    return p * bitcast<f32>(u32(k + 127) << 23u);
}

fn ln_cmm(x: f32) -> f32 {
    if (x < 0.0) {
        return bitcast<f32>(0x7fc00000u);
    }
    if (x < 0x1p-126f) {
        return bitcast<f32>(0xff800000u);
    }
    if (x > 0x1.fffffep+127f) {
        return x;
    }
    let bits = bitcast<u32>(x);
    var e = i32((bits >> 23u) & 0xffu) - 127;
    var m = bitcast<f32>((bits & 0x007fffffu) | 0x3f800000u);
    if (m > LN_SQRT2) {
        m = m * 0.5;
        e = e + 1;
    }
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let q = z * (0x1.555556p-1f + z * (0x1.99999ap-2f + z * (0x1.24924ap-2f + z * 0x1.c71c72p-3f)));
    let ln_m = s * (2.0 + q);
    let ef = f32(e);
    return ef * EXP_LN2_HI + (ef * EXP_LN2_LO + ln_m);
}
