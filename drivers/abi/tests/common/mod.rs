//! Shared by the conformance tests: the Rust mirror's layout as data, a small
//! parser for the C header, and a probe that compiles the header with the
//! system C compiler and prints what C thinks of every struct and constant.
#![allow(dead_code)] // each test binary uses a different part

use devhost_abi::*;
use std::collections::BTreeMap;
use std::mem::{align_of, offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Where a field lies in a struct: byte offset and width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub offset: usize,
    pub size: usize,
}

/// Size, alignment and fields (in declaration order) of one struct.
#[derive(Debug, Default)]
pub struct Layout {
    pub size: usize,
    pub align: usize,
    pub fields: Vec<(String, Place)>,
}

/// The size of a field's type, from a projection closure.
fn width<T, F>(_: fn(&T) -> &F) -> usize {
    size_of::<F>()
}

macro_rules! rust_layout {
    ($map:ident, $ty:ident { $($field:ident),* $(,)? }) => {
        $map.insert(
            stringify!($ty).to_string(),
            Layout {
                size: size_of::<$ty>(),
                align: align_of::<$ty>(),
                fields: vec![$((
                    stringify!($field).to_string(),
                    Place { offset: offset_of!($ty, $field), size: width(|s: &$ty| &s.$field) },
                )),*],
            },
        );
    };
}

/// The `#[repr(C)]` mirror's layout of every ABI struct, by C name.
pub fn rust_layouts() -> BTreeMap<String, Layout> {
    let mut m = BTreeMap::new();
    rust_layout!(m, devhost_str { ptr, len });
    rust_layout!(m, devhost_kv { key, value });
    rust_layout!(
        m,
        devhost_host_api {
            struct_size,
            abi_major,
            abi_minor,
            host_ctx,
            log,
            devices_changed,
            set_error,
            device_begin,
            device_attr,
            device_link,
            add_device_node,
            add_mount,
            add_env,
            add_annotation,
            add_cdi_device,
            prefer_device,
            device_health_reason,
            claim_parameters,
        }
    );
    rust_layout!(
        m,
        devhost_driver_desc {
            magic,
            struct_size,
            abi_major,
            abi_minor,
            reserved0,
            capabilities,
            name,
            version,
            description,
            create,
            destroy,
            scan,
            allocate,
            preferred_allocation,
            pre_start,
            watch_start,
            watch_stop,
            release,
        }
    );
    m
}

/// What the header text declares.
#[derive(Debug, Default)]
pub struct HeaderFacts {
    /// `typedef struct NAME { ... } NAME;` bodies: struct name → field names in order.
    pub structs: BTreeMap<String, Vec<String>>,
    /// `#define DEVHOST_*` with a numeric value.
    pub numeric_defines: Vec<String>,
    /// `#define DEVHOST_*` with a string literal value, unquoted.
    pub string_defines: BTreeMap<String, String>,
}

fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("/*") {
        out.push_str(&rest[..start]);
        out.push(' ');
        rest = rest[start + 2..].find("*/").map_or("", |end| &rest[start + 2 + end + 2..]);
    }
    out.push_str(rest);
    out.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The declared name of one struct member: `T *name`, `T name`, or `R (*name)(...)`.
fn member_name(decl: &str) -> String {
    let decl = decl.trim();
    let name_part = match decl.find("(*") {
        Some(i) => &decl[i + 2..decl[i..].find(')').map_or(decl.len(), |j| i + j)],
        None => decl,
    };
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    name_part.trim_end_matches(|c: char| !ident(c)).rsplit(|c: char| !ident(c)).next().unwrap_or("").to_string()
}

pub fn parse_header(text: &str) -> HeaderFacts {
    let text = strip_comments(text);
    let mut facts = HeaderFacts::default();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("#define") {
            continue;
        }
        let Some(name) = words.next().filter(|n| n.starts_with("DEVHOST_")) else {
            continue;
        };
        let value = words.collect::<Vec<_>>().join(" ");
        if value.is_empty() || value.starts_with("__attribute__") {
            continue; // the include guard and the export attribute
        }
        if let Some(s) = value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
            facts.string_defines.insert(name.to_string(), s.to_string());
        } else {
            facts.numeric_defines.push(name.to_string());
        }
    }
    let mut rest = text.as_str();
    while let Some(start) = rest.find("typedef struct ") {
        rest = &rest[start + "typedef struct ".len()..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let after_name = rest[name.len()..].trim_start();
        if !after_name.starts_with('{') {
            continue; // an opaque type such as devhost_call
        }
        let body_start = rest.find('{').unwrap_or(0) + 1;
        let body_end = rest.find('}').unwrap_or(rest.len());
        let fields = rest[body_start..body_end].split(';').filter(|d| !d.trim().is_empty()).map(member_name).collect();
        facts.structs.insert(name, fields);
        rest = &rest[body_end..];
    }
    facts
}

/// The header the crate ships.
pub fn current_header() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("include/devhost_driver.h")
}

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    root.canonicalize().unwrap_or(root)
}

pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// A C program that includes `header` and prints one line per fact:
/// `struct NAME SIZE ALIGN`, `field NAME.FIELD OFFSET SIZE`, `const NAME VALUE`,
/// `string NAME VALUE`.
pub fn probe_source(
    header: &str,
    structs: &BTreeMap<String, Vec<String>>,
    constants: &[String],
    strings: &[String],
) -> String {
    let mut c = format!(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"{header}\"\n\n\
         static void signed_const(const char *name, long long v) {{ printf(\"const %s %lld\\n\", name, v); }}\n\
         static void unsigned_const(const char *name, unsigned long long v) {{ printf(\"const %s %llu\\n\", name, v); }}\n\
         /* Prints a constant in the signedness of its own type, so -1 stays -1 and 1ull << 63 stays positive. */\n\
         #define CONST(x) _Generic((x), int: signed_const, long: signed_const, long long: signed_const, \\\n\
             default: unsigned_const)(#x, (x))\n\n\
         int main(void) {{\n"
    );
    for (name, fields) in structs {
        c += &format!("    printf(\"struct {name} %zu %zu\\n\", sizeof({name}), _Alignof({name}));\n");
        for f in fields {
            c += &format!(
                "    printf(\"field {name}.{f} %zu %zu\\n\", offsetof({name}, {f}), sizeof((({name} *)0)->{f}));\n"
            );
        }
    }
    for k in constants {
        c += &format!("    CONST({k});\n");
    }
    for s in strings {
        c += &format!("    printf(\"string {s} %s\\n\", {s});\n");
    }
    c + "    return 0;\n}\n"
}

/// The C compiler: `$CC`, or the system `cc`.
pub fn compiler() -> std::ffi::OsString {
    std::env::var_os("CC").unwrap_or_else(|| "cc".into())
}

/// A fresh scratch directory, unique per call: tests run in parallel threads
/// and must not compile into or execute each other's files.
pub fn scratch(name: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("abi-{name}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
    dir
}

/// Runs the compiler with the project's strict C flags plus `args`; panics
/// with the compiler's output on failure.
pub fn cc(args: &[&std::ffi::OsStr]) {
    let mut cmd = Command::new(compiler());
    cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror"]).args(args);
    let out = cmd.output().unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Compiles and runs a probe against the header at `header`, returning its output.
pub fn run_probe(name: &str, header: &Path, source: &str) -> Measured {
    let dir = scratch(name);
    let src = dir.join("probe.c");
    let exe = dir.join("probe");
    std::fs::write(&src, source).unwrap_or_else(|e| panic!("writing {}: {e}", src.display()));
    let include = header.parent().expect("header has a directory");
    cc(&["-I".as_ref(), include.as_os_str(), "-o".as_ref(), exe.as_os_str(), src.as_os_str()]);
    let out = Command::new(&exe).output().unwrap_or_else(|e| panic!("running {}: {e}", exe.display()));
    assert!(out.status.success(), "{} failed: {}", exe.display(), out.status);
    let measured = Measured::parse(&String::from_utf8_lossy(&out.stdout));
    let _ = std::fs::remove_dir_all(&dir); // kept only when something failed
    measured
}

/// What the C compiler reported.
#[derive(Debug, Default)]
pub struct Measured {
    pub structs: BTreeMap<String, (usize, usize)>,
    pub fields: BTreeMap<(String, String), Place>,
    pub constants: BTreeMap<String, i128>,
    pub strings: BTreeMap<String, String>,
}

impl Measured {
    fn parse(output: &str) -> Self {
        let mut m = Self::default();
        let num = |s: &str| s.parse::<i128>().unwrap_or_else(|e| panic!("probe printed {s:?}: {e}"));
        for line in output.lines() {
            let parts: Vec<&str> = line.split(' ').collect();
            match parts.as_slice() {
                ["struct", name, size, align] => {
                    m.structs.insert(name.to_string(), (num(size) as usize, num(align) as usize));
                }
                ["field", path, offset, size] => {
                    let (s, f) = path.split_once('.').expect("struct.field");
                    m.fields
                        .insert((s.into(), f.into()), Place { offset: num(offset) as usize, size: num(size) as usize });
                }
                ["const", name, value] => {
                    m.constants.insert(name.to_string(), num(value));
                }
                ["string", name, value @ ..] => {
                    m.strings.insert(name.to_string(), value.join(" "));
                }
                _ => panic!("unexpected probe line {line:?}"),
            }
        }
        m
    }
}

/// Panics with every entry of `problems`, one per line, if there are any.
pub fn assert_none(what: &str, problems: Vec<String>) {
    assert!(problems.is_empty(), "{what}:\n  {}", problems.join("\n  "));
}

/// The Rust value of a constant in `CONSTANTS`.
pub fn rust_constant(name: &str) -> Option<i128> {
    CONSTANTS.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
}
