//! The spec files checked against the CDI specification's rules, and the writer's file handling.

use super::*;
use crate::driver::device::Mount;
use serde_json::{Value, json};
use std::os::unix::fs::MetadataExt;

/// The CDI specification's rules (SPEC.md and the reference validator), written as a check:
/// required fields, no unknown fields (spec loading fails on them), the kind, device name and env
/// formats, non-empty device edits, and the minimum version each feature needs.
fn check_spec(spec: &Value) -> Result<(), String> {
    fn keys(v: &Value, allowed: &[&str], what: &str) -> Result<(), String> {
        let obj = v.as_object().ok_or(format!("{what} is not an object"))?;
        match obj.keys().find(|k| !allowed.contains(&k.as_str())) {
            Some(k) => Err(format!("{what} has unknown field {k}")),
            None => Ok(()),
        }
    }
    fn segment(s: &str) -> bool {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars().last().is_some_and(|c| c.is_ascii_alphanumeric())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
    }
    keys(spec, &["cdiVersion", "kind", "annotations", "devices", "containerEdits"], "spec")?;
    let version = spec["cdiVersion"].as_str().ok_or("cdiVersion missing")?;
    let known = ["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"];
    let at_least = |v: &str| known.iter().position(|k| *k == version) >= known.iter().position(|k| *k == v);
    if !known.contains(&version) {
        return Err(format!("unknown cdiVersion {version}"));
    }
    let kind = spec["kind"].as_str().ok_or("kind missing")?;
    let (vendor, class) = kind.split_once('/').ok_or("kind has no /")?;
    if !segment(vendor) || !segment(class) || class.len() > 63 {
        return Err(format!("bad kind {kind}"));
    }
    if class.contains('.') && !at_least("0.6.0") {
        return Err("a dot in the class needs 0.6.0".into());
    }
    let devices = spec["devices"].as_array().ok_or("devices missing")?;
    if devices.is_empty() {
        return Err("a spec needs at least one device".into());
    }
    let mut names = BTreeSet::new();
    for d in devices {
        keys(d, &["name", "annotations", "containerEdits"], "device")?;
        let name = d["name"].as_str().ok_or("device name missing")?;
        if !is_device_name(name) || !names.insert(name) {
            return Err(format!("bad or repeated device name {name:?}"));
        }
        if !name.starts_with(|c: char| c.is_ascii_alphabetic()) && !at_least("0.5.0") {
            return Err("a device name starting with a digit needs 0.5.0".into());
        }
        let edits = &d["containerEdits"];
        keys(
            edits,
            &["env", "deviceNodes", "hooks", "mounts", "intelRdt", "additionalGids", "netDevices"],
            "containerEdits",
        )?;
        if edits.as_object().is_none_or(|o| o.values().all(|v| v.as_array().is_some_and(|a| a.is_empty()))) {
            return Err(format!("device {name} has empty containerEdits"));
        }
        for e in edits["env"].as_array().into_iter().flatten() {
            let e = e.as_str().ok_or("env entry is not a string")?;
            if e.find('=').is_none_or(|i| i == 0) {
                return Err(format!("env entry {e:?} is not VAR=VALUE"));
            }
        }
        for n in edits["deviceNodes"].as_array().into_iter().flatten() {
            let allowed = ["path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"];
            keys(n, &allowed, "deviceNode")?;
            if n["path"].as_str().is_none_or(|p| !p.starts_with('/')) {
                return Err(format!("device node path {} is not absolute", n["path"]));
            }
            if n.get("hostPath").is_some() && !at_least("0.5.0") {
                return Err("hostPath needs 0.5.0".into());
            }
            if n["permissions"].as_str().is_some_and(|p| !p.chars().all(|c| "rwm".contains(c))) {
                return Err(format!("bad permissions {}", n["permissions"]));
            }
        }
        for m in edits["mounts"].as_array().into_iter().flatten() {
            keys(m, &["hostPath", "containerPath", "type", "options"], "mount")?;
            if m["hostPath"].as_str().is_none_or(str::is_empty) || m["containerPath"].as_str().is_none_or(str::is_empty)
            {
                return Err("mount without hostPath or containerPath".into());
            }
            if m["options"].as_array().is_some_and(|o| o.iter().any(|x| !x.is_string())) {
                return Err("mount options must be strings".into());
            }
        }
    }
    Ok(())
}

fn dev(id: &str, n: usize, env: &[(&str, &str)]) -> Device {
    let accel = format!("/dev/accel{n}");
    let mut d = Device::test(id).node(&accel, &accel);
    d.edits.mounts = vec![
        Mount { host_path: "/opt/lib".into(), container_path: "/usr/lib/x".into(), read_only: true },
        Mount { host_path: format!("/run/x{n}"), container_path: format!("/run/x{n}"), read_only: false },
    ];
    d.edits.envs = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    d
}

fn spec_of(resource: &str, devices: &[Device]) -> Value {
    serde_json::from_slice(&render(resource, devices).expect("a spec")).expect("valid JSON")
}

#[test]
fn spec_follows_the_cdi_rules_and_carries_each_devices_edits() {
    let devices = [dev("0", 0, &[("MODE", "fast")]), dev("GPU-8c1e", 1, &[])];
    let spec = spec_of("example.com/gpu", &devices);
    check_spec(&spec).unwrap();
    assert_eq!(spec["cdiVersion"], "0.5.0");
    assert_eq!(spec["kind"], "example.com/gpu");
    let d0 = &spec["devices"][0];
    assert_eq!(d0["name"], "0");
    assert_eq!(d0["containerEdits"]["env"], json!(["MODE=fast"]));
    assert_eq!(
        d0["containerEdits"]["deviceNodes"],
        json!([{ "path": "/dev/accel0", "hostPath": "/dev/accel0", "permissions": "rw" }])
    );
    assert_eq!(d0["containerEdits"]["mounts"][0]["options"], json!(["ro", "nosuid", "nodev", "bind"]));
    assert_eq!(d0["containerEdits"]["mounts"][1]["options"], json!(["rw", "nosuid", "nodev", "bind"]));
    assert_eq!(spec["devices"][1]["name"], "GPU-8c1e");
    assert!(spec["devices"][1]["containerEdits"].get("env").is_none(), "no empty arrays");
}

#[test]
fn the_spec_check_itself_rejects_violations() {
    let good = spec_of("example.com/gpu", &[dev("a", 0, &[("K", "v")])]);
    type Breaking = fn(&mut Value);
    let breakages: [(&str, Breaking); 6] = [
        ("bad name", |s| s["devices"][0]["name"] = json!("-a")),
        ("empty edits", |s| s["devices"][0]["containerEdits"] = json!({})),
        ("env", |s| s["devices"][0]["containerEdits"]["env"] = json!(["=v"])),
        ("unknown field", |s| s["extra"] = json!(1)),
        ("old version", |s| s["cdiVersion"] = json!("0.4.0")),
        ("kind", |s| s["kind"] = json!("1example.com/gpu")),
    ];
    for (what, breaking) in breakages {
        let mut spec = good.clone();
        breaking(&mut spec);
        assert!(check_spec(&spec).is_err(), "{what} was accepted");
    }
}

#[test]
fn a_dot_in_the_class_needs_cdi_0_6_0() {
    let spec = spec_of("example.com/gpu.v2", &[dev("a", 0, &[])]);
    assert_eq!(spec["cdiVersion"], "0.6.0");
    check_spec(&spec).unwrap();
}

#[test]
fn device_ids_become_valid_distinct_cdi_names() {
    for id in ["0", "GPU-8c1e-77", "0000:3b:00.0", "gpu0::3", "a_b"] {
        assert_eq!(device_name(id), id, "valid IDs are kept");
    }
    let odd = ["a/b", "a b", "-x", "x-", "", "é", "a_b/"];
    let names: BTreeSet<String> = odd.iter().map(|id| device_name(id)).collect();
    assert_eq!(names.len(), odd.len(), "{names:?}");
    for n in &names {
        assert!(is_device_name(n), "{n}");
    }
    assert!(device_name("a/b").starts_with("a_b-"), "{}", device_name("a/b"));
    assert_eq!(qualified_name("example.com/gpu", "a/b"), format!("example.com/gpu={}", device_name("a/b")));
}

#[test]
fn an_id_shaped_like_a_hashed_name_never_shares_a_spec_entry_with_another_id() {
    // Found by tests/fuzz (compose): ID `a_b-<hash of a/b>` is a valid name, and was its own.
    let hashed = device_name("a/b");
    assert_ne!(device_name(&hashed), hashed);
    let devices = [dev("a/b", 0, &[]), dev(&hashed, 1, &[])];
    let (_, bytes) = &render_all("example.com/gpu", &devices)[0];
    let spec: Value = serde_json::from_slice(bytes).unwrap();
    check_spec(&spec).unwrap();
    assert_eq!(device_name("card-1234567"), "card-1234567", "7 hex digits are not a hash");
}

#[test]
fn file_and_annotation_names() {
    assert_eq!(file_name("nvidia.com/gpu"), "devhost-nvidia.com_gpu.json");
    assert_eq!(annotation_key("nvidia.com/gpu"), "cdi.k8s.io/devhost_nvidia.com_gpu");
    let long = format!("{}.example.com/{}", "d".repeat(60), "g".repeat(60));
    let key = annotation_key(&long);
    let name = key.strip_prefix(ANNOTATION_PREFIX).unwrap();
    assert_eq!(name.len(), 63, "{key}");
    assert!(name.ends_with(|c: char| c.is_ascii_alphanumeric()));
    assert_ne!(annotation_key(&long), annotation_key(&long.replace("g", "h")), "long keys stay distinct");
}

#[test]
fn list_variables_stay_out_of_the_spec_and_come_back_joined() {
    let devices = [dev("a", 0, &[("VIS", "a"), ("MODE", "x")]), dev("b", 1, &[("VIS", "b"), ("MODE", "x")])];
    let spec = spec_of("example.com/gpu", &devices);
    assert_eq!(spec["devices"][0]["containerEdits"]["env"], json!(["MODE=x"]));
    let (composed, _) = crate::driver::device::compose([&devices[1], &devices[0]]);
    let ids = vec!["b".to_string(), "a".to_string()];
    let out = allocate_edits("example.com/gpu", &devices, &ids, composed);
    assert_eq!(out.envs, vec![("VIS".to_string(), "b,a".to_string())]);
    assert!(out.device_nodes.is_empty() && out.mounts.is_empty(), "the runtime applies them from the spec");
    assert_eq!(out.cdi_devices, ["example.com/gpu=b", "example.com/gpu=a"]);
    assert_eq!(
        out.annotations,
        vec![("cdi.k8s.io/devhost_example.com_gpu".to_string(), "example.com/gpu=b,example.com/gpu=a".to_string())]
    );
}

#[test]
fn allocate_names_physical_devices_of_replicas_and_keeps_driver_parts() {
    let physical = [dev("a", 0, &[]), dev("b", 1, &[])];
    let advertised = crate::engine::sharing::expand(&physical, 3);
    let composed = Edits {
        annotations: vec![("vendor/x".into(), "1".into())],
        cdi_devices: vec!["vendor.com/extra=all".into()],
        ..Edits::default()
    };
    let out = allocate_edits("example.com/gpu", &advertised, &["b".to_string()], composed);
    assert_eq!(out.cdi_devices, ["example.com/gpu=b", "vendor.com/extra=all"]);
    assert_eq!(out.annotations[0], ("vendor/x".to_string(), "1".to_string()));
    assert_eq!(out.annotations[1].1, "example.com/gpu=b");
}

#[test]
fn a_large_request_is_named_as_a_small_one_is() {
    // Past 16 IDs the devices are found through a map of the list instead of a look through it:
    // the same names, in request order, for physical devices and for replicas of them, with a
    // device that has no edits left out.
    let mut physical: Vec<Device> = (0..40).map(|i| dev(&format!("g{i}"), i, &[])).collect();
    physical[7].edits = Edits::default();
    let advertised = crate::engine::sharing::expand(&physical, 2);
    for devices in [&physical, &advertised] {
        for count in [3, 30] {
            let ids: Vec<String> = (0..count).rev().map(|i| format!("g{i}")).collect();
            let composed = Edits { cdi_devices: vec!["vendor.com/extra=all".into()], ..Edits::default() };
            let out = allocate_edits("example.com/gpu", devices, &ids, composed);
            let mut want: Vec<String> =
                ids.iter().filter(|id| *id != "g7").map(|id| format!("example.com/gpu={id}")).collect();
            let annotation = want.join(",");
            want.push("vendor.com/extra=all".into());
            assert_eq!(out.cdi_devices, want, "{count} of {} devices", devices.len());
            assert_eq!(out.annotations.last().map(|(_, v)| v.as_str()), Some(annotation.as_str()));
        }
    }
}

#[test]
fn devices_without_edits_are_left_out_and_an_empty_spec_is_no_file() {
    let mut bare = dev("bare", 9, &[]);
    bare.edits = Edits::default();
    let spec = spec_of("example.com/gpu", &[bare.clone(), dev("a", 0, &[])]);
    assert_eq!(spec["devices"].as_array().unwrap().len(), 1);
    assert_eq!(render("example.com/gpu", &[bare.clone()]), None);
    let (composed, _) = crate::driver::device::compose([&bare]);
    let out = allocate_edits("example.com/gpu", &[bare], &["bare".to_string()], composed);
    assert!(out.cdi_devices.is_empty() && out.annotations.is_empty());
}

#[test]
fn write_replaces_by_rename_and_skips_unchanged_content() {
    let dir = tempfile::tempdir().unwrap();
    let writer = CdiWriter::new(dir.path().join("cdi"));
    let path = writer.path("example.com/gpu");
    assert!(writer.write("example.com/gpu", &[dev("a", 0, &[])]).unwrap());
    check_spec(&serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()).unwrap();
    let first = std::fs::metadata(&path).unwrap();
    assert!(!writer.write("example.com/gpu", &[dev("a", 0, &[])]).unwrap(), "unchanged: no write");
    let same = std::fs::metadata(&path).unwrap();
    assert_eq!((same.ino(), same.modified().unwrap()), (first.ino(), first.modified().unwrap()));
    assert!(writer.write("example.com/gpu", &[dev("a", 0, &[]), dev("b", 1, &[])]).unwrap());
    let changed = std::fs::metadata(&path).unwrap();
    assert_ne!(changed.ino(), first.ino(), "a new file was renamed into place");
    let files: Vec<_> = std::fs::read_dir(writer.dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(files, [std::ffi::OsString::from("devhost-example.com_gpu.json")], "no temporary files left");
}

#[test]
fn readers_never_see_a_partial_spec() {
    let dir = tempfile::tempdir().unwrap();
    let writer = CdiWriter::new(dir.path());
    let path = writer.path("example.com/gpu");
    let big: Vec<Device> = (0..200).map(|i| dev(&format!("d{i}"), i, &[])).collect();
    writer.write("example.com/gpu", &big[..1]).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (path, done) = (path.clone(), done.clone());
        std::thread::spawn(move || {
            let mut reads = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let bytes = std::fs::read(&path).expect("the file is always there");
                serde_json::from_slice::<Value>(&bytes).expect("always a whole spec");
                reads += 1;
            }
            reads
        })
    };
    for round in 0..100 {
        writer.write("example.com/gpu", &big[..1 + round % 2 * 199]).unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(reader.join().unwrap() > 0);
}

#[test]
fn remove_deletes_the_spec_once() {
    let dir = tempfile::tempdir().unwrap();
    let writer = CdiWriter::new(dir.path());
    writer.write("example.com/gpu", &[dev("a", 0, &[])]).unwrap();
    assert!(writer.remove("example.com/gpu").unwrap());
    assert!(!writer.path("example.com/gpu").exists());
    assert!(!writer.remove("example.com/gpu").unwrap());
    // A device list that no longer has anything to describe removes the file too.
    writer.write("example.com/gpu", &[dev("a", 0, &[])]).unwrap();
    assert!(writer.write("example.com/gpu", &[]).unwrap());
    assert!(!writer.path("example.com/gpu").exists());
}

#[test]
fn remove_stale_touches_only_devhosts_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    let writer = CdiWriter::new(dir.path());
    writer.write("example.com/gpu", &[dev("a", 0, &[])]).unwrap();
    writer.write("example.com/old", &[dev("a", 0, &[])]).unwrap();
    std::fs::write(dir.path().join("nvidia.yaml"), "x").unwrap();
    std::fs::write(dir.path().join(".devhost-example.com_gpu.json.1-0.tmp"), "{").unwrap();
    let mut removed = writer.remove_stale(&["example.com/gpu"]).unwrap();
    removed.sort();
    assert_eq!(
        removed,
        [dir.path().join(".devhost-example.com_gpu.json.1-0.tmp"), dir.path().join("devhost-example.com_old.json")]
    );
    assert!(writer.path("example.com/gpu").exists() && dir.path().join("nvidia.yaml").exists());
    assert_eq!(CdiWriter::new(dir.path().join("missing")).remove_stale(&[]).unwrap(), Vec::<PathBuf>::new());
}

/// `dev` that also declares CDI names of its own, as the NVIDIA driver's `cdi` strategy does.
fn declaring(id: &str, n: usize, names: &[&str]) -> Device {
    let mut d = dev(id, n, &[]);
    d.edits.cdi_devices = names.iter().map(|s| s.to_string()).collect();
    d
}

fn names_in(spec: &[u8]) -> (String, Vec<String>) {
    let v: Value = serde_json::from_slice(spec).unwrap();
    check_spec(&v).unwrap();
    let names = v["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap().to_string()).collect();
    (v["kind"].as_str().unwrap().to_string(), names)
}

#[test]
fn a_name_one_device_declares_is_defined_under_its_own_kind_with_the_devices_edits() {
    let mut bare = declaring("GPU-c", 2, &["nvidia.com/gpu=GPU-c"]);
    bare.edits.device_nodes.clear();
    bare.edits.mounts.clear();
    let devices = [
        declaring("GPU-a", 0, &["nvidia.com/gpu=GPU-a", "vendor.com/x=all"]),
        declaring("GPU-b", 1, &["nvidia.com/gpu=GPU-b", "vendor.com/x=all", "bad name"]),
        bare,
    ];
    let specs = render_all("nvidia.com/h100", &devices);
    let got: Vec<(String, Vec<String>)> = specs.iter().map(|(_, b)| names_in(b)).collect();
    // A name two devices share stands for neither; a device without edits defines nothing.
    assert_eq!(
        got,
        [
            ("nvidia.com/gpu".to_string(), vec!["GPU-a".to_string(), "GPU-b".to_string()]),
            ("nvidia.com/h100".to_string(), vec!["GPU-a".to_string(), "GPU-b".to_string()]),
        ]
    );
    let spec: Value = serde_json::from_slice(&specs[0].1).unwrap();
    assert_eq!(spec["devices"][1]["containerEdits"]["deviceNodes"][0]["path"], "/dev/accel1");
    assert_eq!(kind_file_name("nvidia.com/h100", "nvidia.com/gpu"), "devhost-nvidia.com_h100+nvidia.com_gpu.json");
    // Under the resource's own kind the names join its file, each once.
    let same = render_all("nvidia.com/gpu", &[declaring("GPU-a", 0, &["nvidia.com/gpu=GPU-a", "nvidia.com/gpu=0"])]);
    assert_eq!(same.len(), 1);
    assert_eq!(names_in(&same[0].1).1, ["GPU-a", "0"]);
}

#[test]
fn allocate_in_edits_mode_takes_a_defined_names_edits_through_the_name() {
    let d = declaring("GPU-a", 0, &["nvidia.com/gpu=GPU-a"]);
    let mut d = d;
    d.edits.envs = vec![("LIST".into(), "GPU-a".into()), ("MODE".into(), "x".into())];
    d.edits.annotations = vec![("a".into(), "1".into())];
    let vars: BTreeSet<String> = ["LIST".to_string()].into();
    let through = through_names(&d, &vars);
    assert!(through.edits.device_nodes.is_empty() && through.edits.mounts.is_empty());
    assert_eq!(through.edits.envs, [("LIST".to_string(), "GPU-a".to_string())]);
    assert_eq!(through.edits.annotations, d.edits.annotations);
    assert_eq!(through.edits.cdi_devices, ["nvidia.com/gpu=GPU-a"]);
}

#[test]
fn the_writer_keeps_one_file_per_kind_and_removes_a_kind_no_longer_declared() {
    let dir = tempfile::tempdir().unwrap();
    let writer = CdiWriter::new(dir.path());
    let r = "example.com/gpu";
    writer.write(r, &[declaring("a", 0, &["vendor.com/one=a"])]).unwrap();
    let one = dir.path().join("devhost-example.com_gpu+vendor.com_one.json");
    assert!(writer.path(r).exists() && one.exists());
    writer.write(r, &[declaring("a", 0, &["vendor.com/two=a"])]).unwrap();
    let two = dir.path().join("devhost-example.com_gpu+vendor.com_two.json");
    assert!(!one.exists() && two.exists());
    // Another resource's files, and a resource whose name starts the same, are not its own.
    writer.write("example.com/gpu2", &[declaring("b", 1, &["vendor.com/one=b"])]).unwrap();
    assert_eq!(writer.remove_stale(&[r, "example.com/gpu2"]).unwrap(), Vec::<PathBuf>::new());
    assert_eq!(writer.remove_stale(&[r]).unwrap().len(), 2, "gpu2's two files are stale");
    assert!(two.exists());
    assert!(writer.remove(r).unwrap());
    assert!(!two.exists() && !writer.path(r).exists());
}
