//! Every way a manifest can be wrong, each reported at its own `file:line:column`.

use std::path::{Path, PathBuf};

use super::{EXAMPLE, PATH, assert_has, errors, only_error, parse};
use crate::manifest::{Manifest, ManifestErrors};

#[test]
fn syntax_errors_carry_line_and_column() {
    let error = only_error("kubelet_dir = \"/x\"\nname = = 1\n");
    assert!(error.starts_with(&format!("{PATH}:2:8: syntax: ")), "{error}");
}

#[test]
fn syntax_errors_on_separate_lines_are_all_reported() {
    let errors = errors(
        "a = = 1
b = \"unterminated\n[driver.x]\nmodule = 1\nmodule = 2\n",
    );
    assert_has(&errors, &format!("{PATH}:1:5: syntax: "), "");
    assert_has(&errors, &format!("{PATH}:2:"), "");
    assert_has(&errors, &format!("{PATH}:5:1: syntax: "), "duplicate key");
}

#[test]
fn unknown_key_at_top_level() {
    let error = only_error("kubelet_dir = \"/x\"\nkubelet_socket = \"y\"\n");
    assert!(error.starts_with(&format!("{PATH}:2:1: kubelet_socket: unknown field")), "{error}");
    assert!(error.contains("`driver_dir`"), "{error}");
}

#[test]
fn unknown_key_in_a_driver() {
    let error = only_error("[driver.x]\nmodul = \"a.so\"\n");
    assert!(error.starts_with(&format!("{PATH}:2:1: driver.x.modul: unknown field")), "{error}");
}

#[test]
fn unknown_key_in_a_resource() {
    let error = only_error("[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\nmatches = {}\n");
    assert!(error.starts_with(&format!("{PATH}:4:1: resource[0].matches: unknown")), "{error}");
}

#[test]
fn wrong_value_type_is_reported_at_the_value() {
    let error = only_error("[[resource]]\nname = 5\ndriver = \"x\"\n");
    assert!(error.starts_with(&format!("{PATH}:2:8: resource[0].name: invalid type")), "{error}");
}

#[test]
fn missing_required_key_is_reported_at_the_table() {
    let error = only_error("\n[[resource]]\nname = \"a.com/b\"\n");
    assert_eq!(error, format!("{PATH}:2:1: resource[0]: missing field `driver`"));
}

#[test]
fn invalid_resource_name_is_reported_with_the_rule() {
    let error = only_error("[[resource]]\nname = \"Example.com/gpu\"\ndriver = \"x\"\n");
    assert!(error.starts_with(&format!("{PATH}:2:8: resource[0].name: ")), "{error}");
    assert!(error.contains("contains 'E'"), "{error}");
}

#[test]
fn empty_driver_name_is_rejected() {
    let error = only_error("[[resource]]\nname = \"a.com/b\"\ndriver = \"\"\n");
    assert_eq!(error, format!("{PATH}:3:10: resource[0].driver: the driver name is empty"));
}

#[test]
fn driver_names_are_restricted() {
    let errors = errors("[driver.\"a.b\"]\n[[resource]]\nname = \"a.com/b\"\ndriver = \"../x\"\n");
    assert_has(&errors, &format!("{PATH}:1:9: driver.a.b: "), "contains '.'");
    assert_has(&errors, &format!("{PATH}:4:10: resource[0].driver: "), "contains '.'");
}

#[test]
fn empty_match_glob_is_rejected() {
    let error = only_error("[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\nmatch = { model = \"\" }\n");
    assert!(error.starts_with(&format!("{PATH}:4:19: resource[0].match.model: ")), "{error}");
    assert!(error.contains("empty"), "{error}");
}

#[test]
fn non_string_match_glob_is_rejected() {
    let error = only_error("[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\nmatch = { n = 1 }\n");
    assert!(error.starts_with(&format!("{PATH}:4:15: resource[0].match.n: ")), "{error}");
}

#[test]
fn duplicate_resource_names_both_locations() {
    let text = "[[resource]]\nname = \"a.com/b\"\ndriver = \"x\"\n\n\
                [[resource]]\nname = \"a.com/b\"\ndriver = \"y\"\n";
    let error = only_error(text);
    assert_eq!(error, format!("{PATH}:6:8: resource[1].name: resource `a.com/b` is already defined at {PATH}:1:1"));
}

#[test]
fn bad_durations_are_rejected_where_written() {
    let text = "call_timeout = \"10h\"\n[driver.x]\npoll_interval = 0\ncall_timeout = -1\n\
                [driver.y]\npoll_interval = 1.5\ncall_timeout = \"0ms\"\n[driver.z]\ncall_timeout = true\n";
    let errors = errors(text);
    assert_eq!(errors.len(), 6, "{errors:#?}");
    assert_has(&errors, &format!("{PATH}:1:16: call_timeout: "), "`10h` is not a duration");
    assert_has(&errors, &format!("{PATH}:3:17: driver.x.poll_interval: "), "0 is not allowed");
    assert_has(&errors, &format!("{PATH}:4:16: driver.x.call_timeout: "), "negative");
    assert_has(&errors, &format!("{PATH}:6:17: driver.y.poll_interval: "), "fraction");
    assert_has(&errors, &format!("{PATH}:7:16: driver.y.call_timeout: "), "zero");
    assert_has(&errors, &format!("{PATH}:9:16: driver.z.call_timeout: "), "invalid type");
}

#[test]
fn every_error_is_reported_at_once_in_file_order() {
    let text = "bogus = 1\n\
                [driver.x]\nmodul = \"a\"\npoll_interval = \"1h\"\n\
                [[resource]]\nname = \"gpu\"\ndriver = \"x\"\nextra = 2\n\
                [[resource]]\nname = \"a.com/b\"\ndriver = \"\"\nmatch = { m = \"\" }\n";
    let errors = errors(text);
    let locations: Vec<&str> = errors.iter().map(|e| e.trim_start_matches(PATH).split(": ").next().unwrap()).collect();
    assert_eq!(locations, [":1:1", ":3:1", ":4:17", ":6:8", ":8:1", ":11:10", ":12:15"]);
}

#[test]
fn socket_path_too_long_names_the_resource_and_length() {
    let dir = format!("/{}", "k".repeat(70));
    let text = format!(
        "kubelet_dir = \"{dir}\"\n[[resource]]\nname = \"example.com/gpu-{}\"\ndriver = \"x\"\n",
        "a".repeat(10)
    );
    let error = only_error(&text);
    // /kkk… (71) + '/' + "devhost-example.com_gpu-aaaaaaaaaa.sock" (39) = 111 bytes
    assert!(error.starts_with(&format!("{PATH}:3:8: resource[0].name: ")), "{error}");
    assert!(error.contains("is 111 bytes long"), "{error}");
    assert!(error.contains("devhost-example.com_gpu-aaaaaaaaaa.sock"), "{error}");
}

#[test]
fn kubelet_dir_override_is_applied_before_the_length_check() {
    let text =
        format!("kubelet_dir = \"/{}\"\n[[resource]]\nname = \"example.com/gpu\"\ndriver = \"x\"\n", "k".repeat(90));
    assert!(parse(&text).is_err());
    let manifest = Manifest::parse(&text, Path::new(PATH), Some(Path::new("/short"))).unwrap();
    assert_eq!(manifest.kubelet_dir, PathBuf::from("/short"));

    let fine = "[[resource]]\nname = \"example.com/gpu\"\ndriver = \"x\"\n";
    let long = PathBuf::from(format!("/{}", "k".repeat(90)));
    let error = Manifest::parse(fine, Path::new(PATH), Some(&long)).unwrap_err();
    assert!(error.to_string().contains("bytes long"), "{error}");
}

#[test]
fn empty_paths_are_rejected() {
    let errors = errors("kubelet_dir = \"\"\ndriver_dir = \"\"\n[driver.x]\nmodule = \"\"\n");
    assert_has(&errors, &format!("{PATH}:1:15: kubelet_dir: "), "empty");
    assert_has(&errors, &format!("{PATH}:2:14: driver_dir: "), "empty");
    assert_has(&errors, &format!("{PATH}:4:10: driver.x.module: "), "empty");
}

#[test]
fn resource_must_be_an_array_of_tables() {
    let error = only_error("resource = \"a.com/b\"\n");
    assert!(error.starts_with(&format!("{PATH}:1:12: resource: expected an array")), "{error}");
}

/// A small deterministic stand-in for a fuzzer: truncations and byte mutations of a valid
/// manifest must give `Ok` or `Err` with located diagnostics, never a panic.
#[test]
fn mutated_manifests_never_panic_and_errors_are_located() {
    let base = format!("{EXAMPLE}[driver.x.options]\nlist = [1, 2.5, \"s\"]\n[[driver.x.options.t]]\na = 1979-05-27\n");
    let mut variants: Vec<String> = (0..=base.len()).filter_map(|end| base.get(..end).map(str::to_owned)).collect();
    let inserts = ["[", "]", "=", "\"", "'", "\n", "{", "}", ",", ".", "*", "#", "0", "-", "é", "[[", "\\"];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    for _ in 0..400 {
        // xorshift: deterministic and dependency-free
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let mut text = base.clone();
        let mut at = (state as usize) % text.len();
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let insert = inserts[(state >> 32) as usize % inserts.len()];
        if state & 1 == 0 {
            text.insert_str(at, insert);
        } else {
            let end = (at + 1..=text.len()).find(|&e| text.is_char_boundary(e)).unwrap_or(at);
            text.replace_range(at..end, insert);
        }
        variants.push(text);
    }
    let located = |location: &str| {
        let mut parts = location.rsplitn(3, ':');
        let column = parts.next().unwrap_or_default();
        let line = parts.next().unwrap_or_default();
        parts.next() == Some(PATH)
            && line.parse::<usize>().is_ok_and(|n| n >= 1)
            && column.parse::<usize>().is_ok_and(|n| n >= 1)
    };
    let (mut accepted, mut rejected) = (0, 0);
    for text in &variants {
        match parse(text) {
            Ok(_) => accepted += 1,
            Err(ManifestErrors(diagnostics)) => {
                rejected += 1;
                assert!(!diagnostics.is_empty(), "Err without diagnostics for {text:?}");
                for diagnostic in &diagnostics {
                    assert!(located(&diagnostic.location), "{diagnostic} for {text:?}");
                }
            }
        }
    }
    // Both outcomes must be common, or the variants are not exercising the checks.
    assert!(accepted > 50 && rejected > 200, "{accepted} accepted, {rejected} rejected");
}

#[test]
fn unknown_isolation_mode() {
    let error = only_error("[driver.x]\nisolation = \"sandbox\"\n");
    assert!(error.starts_with(&format!("{PATH}:2:13: driver.x.isolation: ")), "{error}");
    assert!(error.contains("\"in-process\" or \"process\""), "{error}");
}

#[test]
fn keep_capabilities_needs_process_isolation() {
    let error = only_error("[driver.x]\nisolation = \"in-process\"\nkeep_capabilities = [\"CAP_SYS_ADMIN\"]\n");
    assert!(error.starts_with(&format!("{PATH}:3:21: driver.x.keep_capabilities: ")), "{error}");
    assert!(error.contains("only applies with isolation = \"process\""), "{error}");
}

#[test]
fn unknown_capability_is_reported_at_its_entry_with_a_hint() {
    let errors = errors(
        "[driver.x]\nisolation = \"process\"\nkeep_capabilities = [\"CAP_SYS_ADMIN\", \"sys_admin\", \"CAP_ROOT\"]\n",
    );
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert_has(&errors, &format!("{PATH}:3:39: driver.x.keep_capabilities: "), "did you mean \"CAP_SYS_ADMIN\"?");
    assert_has(&errors, &format!("{PATH}:3:52: driver.x.keep_capabilities: "), "capabilities(7)");
}
