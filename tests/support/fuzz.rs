//! Fuzzing edits on request bodies, shared by the extender test binaries (`tests/extender_http.rs`,
//! `tests/extender_fixtures.rs`).

use proptest::sample::Index;

/// Applies fuzzing edits to a request body: op 0 overwrites a byte, 1 deletes one, 2 inserts one.
pub fn mutate(body: &mut Vec<u8>, edits: Vec<(Index, u8, u8)>) {
    for (at, op, byte) in edits {
        if body.is_empty() {
            body.push(byte);
            continue;
        }
        let i = at.index(body.len());
        match op {
            0 => body[i] = byte,
            1 => {
                body.remove(i);
            }
            _ => body.insert(i, byte),
        }
    }
}
