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
