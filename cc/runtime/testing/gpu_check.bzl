"""gpu_check_test: a check that needs a CUDA GPU, tagged gpu (`bazel test --config=gpu //...`)."""

load("@rules_shell//shell:sh_test.bzl", "sh_test")
load("@zerokv_cuda//:defs.bzl", CUDA_COMPATIBLE_WITH = "COMPATIBLE_WITH")

def gpu_check_test(name, generator, check, args = [], sanitized_args = [], **kwargs):
    """Writes an input on the GPU with `generator`, then runs `check` over it (gpu_check_test.sh).

    Four shards: the check plainly and under compute-sanitizer memcheck, racecheck and synccheck,
    each on the delegate's own stream and under a non-blocking caller stream.

    Args:
      name: the test.
      generator: an executable run as `generator OUT --device cuda`.
      check: the check binary, run as `check ARGS... MODE [SANITIZED_ARGS...]`.
      args: the check's arguments before the mode; "{input}" stands for OUT.
      sanitized_args: appended under compute-sanitizer only (e.g. fewer steps).
      **kwargs: for the sh_test (size, timeout, ...).
    """
    sh_test(
        name = name,
        srcs = [Label("//cc/runtime/testing:gpu_check_test.sh")],
        args = ["$(rootpath %s)" % generator, "$(rootpath %s)" % check] + args,
        data = [
            generator,
            check,
            Label("@zerokv_cuda//:compute_sanitizer"),
        ],
        env = {
            "COMPUTE_SANITIZER": "$(rootpath %s)" % Label("@zerokv_cuda//:compute_sanitizer"),
            "GPU_CHECK_SANITIZED_ARGS": " ".join(sanitized_args),
        },
        shard_count = 4,
        tags = ["gpu"],
        target_compatible_with = CUDA_COMPATIBLE_WITH,
        **kwargs
    )
