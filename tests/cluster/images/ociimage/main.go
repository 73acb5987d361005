// Command ociimage writes a one-layer container image as an OCI image layout archive, the form
// `ctr images import` reads, from files on this machine: the tests' images are built here because
// nothing can be pulled.
//
//	ociimage -o pause.tar -name localhost/devhost-test/pause:1 -entrypoint /pause FILE=/pause
//	ociimage -o busybox.tar -name localhost/devhost-test/busybox:1 -entrypoint /bin/sh \
//	    -link /bin/sh=busybox /bin/busybox=/bin/busybox
//
// Each argument SRC=DST copies the file SRC to DST in the image (mode kept, owner root); -link
// DST=TARGET adds a symbolic link. Parent folders are made. The layer is an uncompressed tar.
package main

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"path"
	"sort"
	"strings"
	"time"
)

type list []string

func (l *list) String() string     { return strings.Join(*l, ",") }
func (l *list) Set(v string) error { *l = append(*l, v); return nil }

// The OCI image spec's media types and fields (image-spec v1.1).
const (
	mediaIndex    = "application/vnd.oci.image.index.v1+json"
	mediaManifest = "application/vnd.oci.image.manifest.v1+json"
	mediaConfig   = "application/vnd.oci.image.config.v1+json"
	mediaLayer    = "application/vnd.oci.image.layer.v1.tar"
)

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

// epoch keeps the archive the same from build to build.
var epoch = time.Unix(0, 0)

func main() {
	out := flag.String("o", "", "the archive to write")
	name := flag.String("name", "", "the image's name, e.g. localhost/devhost-test/pause:1")
	entry := flag.String("entrypoint", "", "the entrypoint (one path)")
	var links list
	flag.Var(&links, "link", "DST=TARGET: a symbolic link in the image (repeatable)")
	flag.Parse()
	if *out == "" || *name == "" || *entry == "" || flag.NArg() == 0 {
		log.Fatal("ociimage: -o, -name, -entrypoint and at least one SRC=DST are required")
	}
	layer, err := buildLayer(flag.Args(), links)
	if err != nil {
		log.Fatalf("ociimage: %v", err)
	}
	if err := writeLayout(*out, *name, *entry, layer); err != nil {
		log.Fatalf("ociimage: %v", err)
	}
}

// buildLayer is the tar of the files and links, with every parent folder.
func buildLayer(files, links []string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	mkdirs := func(p string) error {
		var parents []string
		for d := path.Dir(p); d != "/" && !dirs[d]; d = path.Dir(d) {
			parents = append(parents, d)
			dirs[d] = true
		}
		sort.Strings(parents)
		for _, d := range parents {
			h := &tar.Header{Typeflag: tar.TypeDir, Name: strings.TrimPrefix(d, "/") + "/", Mode: 0o755, ModTime: epoch}
			if err := tw.WriteHeader(h); err != nil {
				return err
			}
		}
		return nil
	}
	for _, f := range files {
		src, dst, ok := strings.Cut(f, "=")
		if !ok || !path.IsAbs(dst) {
			return nil, fmt.Errorf("%q: want SRC=/absolute/destination", f)
		}
		data, err := os.ReadFile(src)
		if err != nil {
			return nil, err
		}
		st, err := os.Stat(src)
		if err != nil {
			return nil, err
		}
		if err := mkdirs(dst); err != nil {
			return nil, err
		}
		h := &tar.Header{Typeflag: tar.TypeReg, Name: strings.TrimPrefix(dst, "/"), Mode: int64(st.Mode().Perm()),
			Size: int64(len(data)), ModTime: epoch}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	for _, l := range links {
		dst, target, ok := strings.Cut(l, "=")
		if !ok || !path.IsAbs(dst) {
			return nil, fmt.Errorf("-link %q: want /absolute/link=TARGET", l)
		}
		if err := mkdirs(dst); err != nil {
			return nil, err
		}
		h := &tar.Header{Typeflag: tar.TypeSymlink, Name: strings.TrimPrefix(dst, "/"), Linkname: target, Mode: 0o777, ModTime: epoch}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func digest(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// writeLayout writes oci-layout, index.json and the blobs (layer, config, manifest) as a tar.
func writeLayout(out, name, entry string, layer []byte) error {
	config, err := json.Marshal(map[string]any{
		"architecture": "amd64",
		"os":           "linux",
		"config":       map[string]any{"Entrypoint": []string{entry}, "Env": []string{"PATH=/bin:/usr/bin"}},
		"rootfs":       map[string]any{"type": "layers", "diff_ids": []string{digest(layer)}},
	})
	if err != nil {
		return err
	}
	manifest, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaManifest,
		"config":        descriptor{MediaType: mediaConfig, Digest: digest(config), Size: int64(len(config))},
		"layers":        []descriptor{{MediaType: mediaLayer, Digest: digest(layer), Size: int64(len(layer))}},
	})
	if err != nil {
		return err
	}
	_, tag, _ := strings.Cut(name[strings.LastIndex(name, "/")+1:], ":")
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     mediaIndex,
		"manifests": []descriptor{{MediaType: mediaManifest, Digest: digest(manifest), Size: int64(len(manifest)),
			// containerd names the imported image after the first; the second is the spec's own.
			Annotations: map[string]string{"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}}},
	})
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	entries := []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", index},
	}
	for _, b := range [][]byte{layer, config, manifest} {
		entries = append(entries, struct {
			name string
			data []byte
		}{"blobs/sha256/" + strings.TrimPrefix(digest(b), "sha256:"), b})
	}
	for _, d := range []string{"blobs/", "blobs/sha256/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: epoch}); err != nil {
			return err
		}
	}
	for _, e := range entries {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: epoch}); err != nil {
			return err
		}
		if _, err := io.Copy(tw, bytes.NewReader(e.data)); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
