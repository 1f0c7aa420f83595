#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cmm_conformance::fuzz::case_file(data));
