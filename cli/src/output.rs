//! Where `--json` output goes: standard output, or, for a caller in the same process (the
//! Python package), a capture, so that library callers get exactly what the command
//! prints.

use std::cell::RefCell;

use anyhow::Result;

thread_local! {
    static CAPTURE: RefCell<Option<Vec<serde_json::Value>>> = const { RefCell::new(None) };
}

/// Prints `value` as pretty JSON on its own, or hands it to the capture in force.
pub fn emit_json(value: serde_json::Value) -> Result<()> {
    let captured = CAPTURE.with(|c| match c.borrow_mut().as_mut() {
        Some(values) => {
            values.push(value.clone());
            true
        }
        None => false,
    });
    if !captured {
        println!("{}", serde_json::to_string_pretty(&value)?);
    }
    Ok(())
}

/// Runs `f` with the JSON it emits captured (on this thread), and returns both.
pub fn capture_json<T>(f: impl FnOnce() -> Result<T>) -> (Result<T>, Vec<serde_json::Value>) {
    CAPTURE.with(|c| *c.borrow_mut() = Some(Vec::new()));
    let result = f();
    let values = CAPTURE.with(|c| c.borrow_mut().take()).unwrap_or_default();
    (result, values)
}
