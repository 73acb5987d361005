//! What the name rules of CDI (`engine::cdi::device_name`), of DRA
//! (`fronts::dra::prepare::dra_device_name`) and of the ResourceSlices (`slice_name`) share: a
//! stable hash, so that a name made from a device ID or an over-long name is the same after a
//! restart or an upgrade (std's hasher is seeded per process), and the suffix it leaves. Uses
//! nothing else in the crate; anyone may use it.

/// FNV-1a, 32 bits: stable across builds, restarts and architectures.
pub fn fnv1a(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// Whether `name` ends as a hashed name ends: `-` and 8 lowercase hex digits of [`fnv1a`]. A
/// name rule that keeps valid IDs as they are must hash an ID that ends so too, or that ID
/// could take a hashed ID's name.
pub fn has_hash_suffix(name: &str) -> bool {
    let bytes = name.as_bytes();
    bytes.len() >= 9
        && bytes[bytes.len() - 9] == b'-'
        && bytes[bytes.len() - 8..].iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_fnv1a_and_the_suffix_is_what_it_prints() {
        // FNV-1a's published test values.
        assert_eq!(fnv1a(""), 0x811c_9dc5);
        assert_eq!(fnv1a("a"), 0xe40c_292c);
        assert_eq!(fnv1a("foobar"), 0xbf9c_f968);
        assert!(has_hash_suffix(&format!("gpu-{:08x}", fnv1a("gpu 0"))));
        for name in ["gpu-0", "x-811c9dc", "x-811C9DC5", "811c9dc5", "x_811c9dc5"] {
            assert!(!has_hash_suffix(name), "{name}");
        }
    }
}
