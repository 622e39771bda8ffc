// A compiled program's run with Python's GIL released: torch's own binding of
// AOTIModelPackageLoader::run keeps the GIL for the whole forward, so every other Python thread of
// a server (sending responses, taking requests) waits for it.
#include <pybind11/conduit/pybind11_conduit_v1.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/extension.h>

namespace py = pybind11;

namespace torch::inductor {
// The class torch's binding registers as torch._C._aoti.AOTIModelPackageLoader (a subclass of the
// loader adding Python-facing methods only): declared under the same name, pybind11's conduit
// hands over the C++ object a Python loader wraps.
class AOTIModelPackageLoaderPybind : public AOTIModelPackageLoader {
  using AOTIModelPackageLoader::AOTIModelPackageLoader;
};
}  // namespace torch::inductor

static torch::inductor::AOTIModelPackageLoader* as_loader(py::handle loader) {
  auto* bound = pybind11_conduit_v1::get_type_pointer_ephemeral<torch::inductor::AOTIModelPackageLoaderPybind>(
      loader.ptr());
  if (bound == nullptr) {
    PyErr_Clear();
    throw std::runtime_error("not a torch._C._aoti.AOTIModelPackageLoader of this torch build");
  }
  return bound;
}

std::vector<at::Tensor> run(py::handle loader, const std::vector<at::Tensor>& inputs) {
  auto* l = as_loader(loader);
  py::gil_scoped_release released;
  return l->run(inputs);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("check", [](py::handle loader) { as_loader(loader); }, "raises unless this is torch's loader");
  m.def("run", &run, "the loader's run(inputs), the GIL released meanwhile");
}
