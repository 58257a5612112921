"""blob_fixtures: runs make_fixtures.py into a directory (a tree artifact) of blobs and a MANIFEST."""

def _blob_fixtures_impl(ctx):
    out = ctx.actions.declare_directory(ctx.label.name)
    ctx.actions.run(
        executable = ctx.executable.generator,
        arguments = [out.path] + [f.path for f in ctx.files.frozen],
        inputs = ctx.files.frozen,
        outputs = [out],
        mnemonic = "BlobFixtures",
        progress_message = "Writing blob fixtures %{label}",
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles([out]))]

blob_fixtures = rule(
    implementation = _blob_fixtures_impl,
    attrs = {
        "generator": attr.label(executable = True, cfg = "exec", mandatory = True),
        # Older versions' fixtures (v<N>/*.blob and v<N>/MANIFEST), copied in as v<N>_<case>.
        "frozen": attr.label_list(allow_files = True),
    },
)
