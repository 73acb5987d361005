//! Layout conformance: compiles `include/devhost_driver.h` with the system C
//! compiler and checks that every struct size, alignment, field offset and
//! width, and every constant, agrees with the `#[repr(C)]` mirror in
//! `src/lib.rs`; and that the mirror covers every field and constant the
//! header declares, so neither side can drift or be forgotten.

mod common;

use common::*;
use devhost_abi::*;
use std::sync::OnceLock;

/// The header compiled once per test binary, probing what the mirror declares.
fn measured() -> &'static Measured {
    static MEASURED: OnceLock<Measured> = OnceLock::new();
    MEASURED.get_or_init(|| {
        let facts = parse_header(&read(&current_header()));
        let structs =
            rust_layouts().into_iter().map(|(n, l)| (n, l.fields.into_iter().map(|(f, _)| f).collect())).collect();
        // Probe only constants the header defines; `mirror_constants_are_all_in_the_header`
        // reports the others by name instead of as a compile error.
        let constants: Vec<String> =
            CONSTANTS.iter().map(|(n, _)| n.to_string()).filter(|n| facts.numeric_defines.contains(n)).collect();
        let strings: Vec<String> = facts.string_defines.keys().cloned().collect();
        run_probe("layout", &current_header(), &probe_source("devhost_driver.h", &structs, &constants, &strings))
    })
}

/// Every size, alignment, offset and width where C and the mirror disagree.
fn layout_problems(c: &Measured) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, rust) in rust_layouts() {
        let Some(&(size, align)) = c.structs.get(&name) else {
            problems.push(format!("{name}: not measured in C"));
            continue;
        };
        if size != rust.size {
            problems.push(format!("sizeof({name}): C {size}, Rust {}", rust.size));
        }
        if align != rust.align {
            problems.push(format!("alignof({name}): C {align}, Rust {}", rust.align));
        }
        for (field, place) in rust.fields {
            let Some(cp) = c.fields.get(&(name.clone(), field.clone())) else {
                problems.push(format!("{name}.{field}: not measured in C"));
                continue;
            };
            if cp.offset != place.offset {
                problems.push(format!("offsetof({name}, {field}): C {}, Rust {}", cp.offset, place.offset));
            }
            if cp.size != place.size {
                problems.push(format!("sizeof({name}.{field}): C {}, Rust {}", cp.size, place.size));
            }
        }
    }
    problems
}

/// Every constant whose C value differs from `CONSTANTS`.
fn constant_problems(c: &Measured) -> Vec<String> {
    CONSTANTS
        .iter()
        .filter_map(|(name, rust)| match c.constants.get(*name) {
            Some(value) if value != rust => Some(format!("{name}: C {value}, Rust {rust}")),
            // A constant the header lacks is reported by mirror_constants_are_all_in_the_header.
            _ => None,
        })
        .collect()
}

#[test]
fn struct_layouts_match_the_header() {
    assert_none("layout drift between the header and the Rust mirror", layout_problems(measured()));
}

#[test]
fn constants_match_the_header() {
    assert_none("constant drift between the header and the Rust mirror", constant_problems(measured()));
}

#[test]
fn drift_in_a_header_copy_is_reported_by_name() {
    // Proves the comparison can fail: widen one field and change one value in
    // a copy of the header, and both must be reported with both values.
    let text = read(&current_header()).replacen("uint32_t reserved0;", "uint64_t reserved0;", 1).replacen(
        "#define DEVHOST_ERR_TIMEOUT 4u",
        "#define DEVHOST_ERR_TIMEOUT 40u",
        1,
    );
    let dir = scratch("drift");
    let header = dir.join("devhost_driver.h");
    std::fs::write(&header, text).expect("writing the drifted header");
    let facts = parse_header(&read(&header));
    let constants: Vec<String> = CONSTANTS.iter().map(|(n, _)| n.to_string()).collect();
    let c = run_probe("drift-probe", &header, &probe_source("devhost_driver.h", &facts.structs, &constants, &[]));
    let layout = layout_problems(&c);
    assert!(layout.contains(&"sizeof(devhost_driver_desc.reserved0): C 8, Rust 4".to_string()), "{layout:?}");
    assert!(
        layout.iter().any(|p| p.starts_with("offsetof(devhost_driver_desc, capabilities): C 24, Rust 16")),
        "{layout:?}"
    );
    assert_eq!(constant_problems(&c), ["DEVHOST_ERR_TIMEOUT: C 40, Rust 4"]);
}

#[test]
fn mirror_constants_are_all_in_the_header() {
    let facts = parse_header(&read(&current_header()));
    let problems = CONSTANTS
        .iter()
        .filter(|(name, _)| !facts.numeric_defines.iter().any(|d| d == name))
        .map(|(name, _)| format!("{name} is in CONSTANTS but not #defined in the header"))
        .collect();
    assert_none("constants missing from the header", problems);
}

#[test]
fn every_header_constant_is_mirrored() {
    let facts = parse_header(&read(&current_header()));
    assert!(facts.numeric_defines.len() >= 20, "header parse found only {:?}", facts.numeric_defines);
    let problems = facts
        .numeric_defines
        .iter()
        .filter(|d| rust_constant(d).is_none())
        .map(|d| format!("{d} is #defined in the header but missing from devhost_abi::CONSTANTS"))
        .collect();
    assert_none("constants missing from the mirror", problems);
}

#[test]
fn every_header_struct_and_field_is_mirrored_in_order() {
    let facts = parse_header(&read(&current_header()));
    let rust = rust_layouts();
    let mut problems = Vec::new();
    for (name, c_fields) in &facts.structs {
        match rust.get(name) {
            None => problems.push(format!("struct {name} is in the header but not in the layout table")),
            Some(layout) => {
                let r_fields: Vec<&String> = layout.fields.iter().map(|(f, _)| f).collect();
                let c_fields: Vec<&String> = c_fields.iter().collect();
                if r_fields != c_fields {
                    problems.push(format!("{name} fields: header {c_fields:?}, mirror {r_fields:?}"));
                }
            }
        }
    }
    for name in rust.keys().filter(|n| !facts.structs.contains_key(*n)) {
        problems.push(format!("struct {name} is in the layout table but not in the header"));
    }
    assert_none("struct coverage", problems);
}

#[test]
fn entry_symbol_matches() {
    let c = measured();
    assert_eq!(
        c.strings.get("DEVHOST_ENTRY_SYMBOL_V1").map(String::as_str),
        Some(DEVHOST_ENTRY_SYMBOL_V1),
        "DEVHOST_ENTRY_SYMBOL_V1: C {:?}, Rust {DEVHOST_ENTRY_SYMBOL_V1:?}",
        c.strings.get("DEVHOST_ENTRY_SYMBOL_V1")
    );
    // The name the loader resolves is also the function the header declares.
    let header = read(&current_header());
    assert!(
        header.contains(&format!("*{DEVHOST_ENTRY_SYMBOL_V1}(void);")),
        "header does not declare {DEVHOST_ENTRY_SYMBOL_V1}"
    );
}

#[test]
fn minimum_descriptor_ends_after_scan() {
    let scan = measured().fields[&("devhost_driver_desc".to_string(), "scan".to_string())];
    assert_eq!(DESC_MIN_SIZE_V1, scan.offset + scan.size, "DESC_MIN_SIZE_V1 vs offsetof+sizeof(scan) in C");
}

#[test]
fn header_parser_reads_function_pointer_and_pointer_members() {
    let facts = parse_header(
        "/* c */ typedef struct devhost_x {\n const char *name; /* a */\n devhost_status (*create)(const devhost_kv *o,\n size_t n);\n uint32_t (*fp)(void); // z\n} devhost_x;\n\
         typedef struct devhost_opaque devhost_opaque;\n#define DEVHOST_A 1u\n#define DEVHOST_S \"sym\"\n#define DEVHOST_H\n",
    );
    assert_eq!(facts.structs["devhost_x"], ["name", "create", "fp"]);
    assert_eq!(facts.structs.len(), 1);
    assert_eq!(facts.numeric_defines, ["DEVHOST_A"]);
    assert_eq!(facts.string_defines["DEVHOST_S"], "sym");
}
