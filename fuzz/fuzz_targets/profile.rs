#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cmm_cli::fuzz::profile(data));
