"""The `sdks` module extension: zerokv's SDK repositories, found in the environment.

It works the same whether zerokv is the root module or a dependency of another workspace:
    sdks = use_extension("@zerokv//tools/repositories:extensions.bzl", "sdks")
"""

load(":local_sdks.bzl", "local_clang", "local_python", "optional_sdk", "wheel_sdk")

def _sdks_impl(_module_ctx):
    local_python(name = "zerokv_python")
    wheel_sdk(
        name = "zerokv_executorch",
        package = "executorch",
        build_file = Label("//tools/repositories:executorch.BUILD"),
        required_files = [
            "include/executorch/runtime/backend/interface.h",
            "lib/libexecutorch.so",
        ],
    )
    wheel_sdk(
        name = "zerokv_torch",
        package = "torch",
        build_file = Label("//tools/repositories:torch.BUILD"),
        required_files = [
            "include/torch/csrc/inductor/aoti_package/model_package_loader.h",
            "lib/libtorch_cpu.so",
        ],
    )
    optional_sdk(
        name = "zerokv_cuda",
        sdk_name = "CUDA toolkit",
        env_var = "CUDA_HOME",
        default_home = "/usr/local/cuda",
        require_env = "ZEROKV_REQUIRE_CUDA",
        required_files = [
            "bin/nvcc",
            "include/cuda_runtime.h",
            "lib64/libcudart.so",
        ],
        build_file = Label("//tools/repositories:cuda.BUILD"),
    )
    optional_sdk(
        name = "zerokv_tensorrt",
        sdk_name = "TensorRT SDK",
        env_var = "TENSORRT_HOME",
        required_files = [
            "include/NvInfer.h",
            "lib/libnvinfer.so",
        ],
        build_file = Label("//tools/repositories:tensorrt.BUILD"),
    )
    local_clang(name = "zerokv_clang")

sdks = module_extension(implementation = _sdks_impl)
