"""Points the Java classpath of a sid Bazel unpacked into PREFIX at the prefix.

Debian's launcher reads <install_base>/bazel_classpath_debian_depends.txt, which lists absolute
/usr/share/java paths, and the jars' manifests carry absolute Class-Path entries. The classpath file
is rewritten to the prefix with the manifest closure added, then Class-Path is stripped from the
manifests so that the host's own /usr/share/java (bookworm's jars) never reaches the server.

Usage: python3 relocate_bazel_classpath.py PREFIX
"""

import os
import sys
import zipfile

SIGNATURE_SUFFIXES = (".SF", ".RSA", ".DSA", ".EC")


def read_manifest(jar):
    with zipfile.ZipFile(jar) as archive:
        try:
            return archive.read("META-INF/MANIFEST.MF").decode("utf-8", "replace")
        except KeyError:
            return ""


def manifest_class_path(manifest):
    lines = []
    for raw in manifest.splitlines():
        if raw.startswith(" ") and lines:
            lines[-1] += raw[1:]
        else:
            lines.append(raw)
    for line in lines:
        if line.lower().startswith("class-path:"):
            return line.split(":", 1)[1].split()
    return []


def relocate_classpath(prefix):
    classpath_file = os.path.join(prefix, "usr/share/bazel/bazel_classpath_debian_depends.txt")
    with open(classpath_file) as f:
        pending = [line.strip() for line in f if line.strip()]
    seen, jars = set(), []
    while pending:
        jar = pending.pop(0)
        if jar.startswith("/usr/"):
            jar = prefix + jar
        if jar in seen:
            continue
        seen.add(jar)
        if not os.path.exists(jar):  # a few listed jars are not shipped by Debian
            continue
        jars.append(jar)
        for entry in manifest_class_path(read_manifest(jar)):
            pending.append(entry if entry.startswith("/") else os.path.join(os.path.dirname(jar), entry))
    with open(classpath_file, "w") as f:
        f.write("\n".join(jars) + "\n")
    return len(jars)


def strip_manifest_class_paths(java_dir):
    stripped = 0
    for name in os.listdir(java_dir):
        path = os.path.join(java_dir, name)
        if not name.endswith(".jar") or os.path.islink(path):
            continue
        manifest = read_manifest(path)
        if "Class-Path:" not in manifest:
            continue
        with zipfile.ZipFile(path) as archive:
            signed = any(
                info.filename.upper().startswith("META-INF/")
                and info.filename.upper().endswith(SIGNATURE_SUFFIXES)
                for info in archive.infolist()
            )
            if signed:  # rewriting a signed jar's manifest would invalidate it
                continue
            kept, in_class_path = [], False
            for line in manifest.splitlines(keepends=True):
                if line.startswith("Class-Path:"):
                    in_class_path = True
                    continue
                if in_class_path and line.startswith(" "):
                    continue
                in_class_path = False
                kept.append(line)
            with zipfile.ZipFile(path + ".tmp", "w") as out:
                for info in archive.infolist():
                    data = "".join(kept).encode() if info.filename == "META-INF/MANIFEST.MF" else archive.read(info.filename)
                    out.writestr(info, data)
        os.replace(path + ".tmp", path)
        stripped += 1
    return stripped


def main():
    prefix = sys.argv[1]
    jars = relocate_classpath(prefix)
    stripped = strip_manifest_class_paths(os.path.join(prefix, "usr/share/java"))
    print(f"[install_bazel] classpath: {jars} jars, {stripped} manifests stripped")


if __name__ == "__main__":
    main()
