"""DeepSpeed's NVMe ops (async_io, and the pin_memory op it links against), built for the tests in a fraction of the
CPU time that DeepSpeed's own op builder takes, and loaded where DeepSpeed looks for them.

DeepSpeed's builder compiles each C++ file of an op on its own, and eleven of them parse torch/extension.h: about
28 s of CPU each on CI's cores, five to six minutes for the two ops, the largest single cost of a cold CPU suite.
Here the same sources, with async_io's builder's flags (less -g) and libraries, are compiled as one library with one
translation unit for the files of both ops that include torch's headers (the files that do not are compiled on their
own, as DeepSpeed does: they share file-local names). Parsing torch/extension.h was three quarters of each op's unit
(22 s of pin_memory's 30 s of CPU), so it is parsed once. The library holds both Python modules, pin_memory's under its
own name; async_io's client of the pin manager, which looks for pin_memory's library at run time, gives way to the
manager itself. The modules are then registered under DeepSpeed's op names, so ZeRO-Infinity's own
``AsyncIOBuilder().load()`` returns them, in this process and in the ranks forked from it. Nothing of DeepSpeed's
is changed on disk: its sources are copied, and each copied header is given the include guard (``#pragma once``)
that a single translation unit needs (DeepSpeed's headers have none).
"""
from __future__ import annotations

import os
import re
import sys

_HEADER_GUARD = "#pragma once\n"
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def _write_if_changed(path: str, text: str) -> None:
    """Write only a changed file: ninja rebuilds what is newer than its output."""
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _one_unit_builder(base, merged=None, replaced: tuple[str, ...] = ()):
    """A subclass of DeepSpeed's builder ``base`` that builds ``base``'s sources as described above, under the name
    ``<name>_unity`` (its own folder in TORCH_EXTENSIONS_DIR, never DeepSpeed's build of the op). ``merged``: another
    builder whose sources join the same library and unit, its Python module named ``<its name>_unity`` (``NAMES``),
    less ``base``'s sources named in ``replaced`` (those that reach across to ``merged``'s library at run time)."""

    class OneUnit(base):
        NAME = base.NAME + "_unity"
        NAMES = [NAME] + ([merged.NAME + "_unity"] if merged else [])

        def _copy_dir(self) -> str:
            import deepspeed
            return os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions")),
                                "deepspeed_sources", deepspeed.__version__, base.NAME)

        def include_paths(self):
            return [os.path.join(self._copy_dir(), path) for path in super().include_paths()]

        def sources(self):
            own = [path for path in super().sources() if os.path.basename(path) not in replaced]
            joined = merged().sources() if merged else []
            copy_dir = self._copy_dir()
            src = [self.deepspeed_src_path(path) for path in own + joined]
            dirs = sorted({os.path.dirname(path) for path in src} | {self.deepspeed_src_path(p) for p in super().include_paths()})
            root = os.path.dirname(self.deepspeed_src_path("csrc"))  # the copies keep DeepSpeed's layout below it
            for folder in dirs:  # every file of the op's folders, headers guarded
                for name in os.listdir(folder):
                    if name.endswith((".h", ".hpp", ".cpp")):
                        with open(os.path.join(folder, name), encoding="utf-8") as f:
                            text = f.read()
                        guard = _HEADER_GUARD if name.endswith((".h", ".hpp")) and "#pragma once" not in text else ""
                        _write_if_changed(os.path.join(copy_dir, os.path.relpath(folder, root), name), guard + text)
            copies = [os.path.join(copy_dir, os.path.relpath(path, root)) for path in src]
            with_torch = [path for path in copies if self._includes_torch(path, set())]
            lines = [f'#include "{path}"\n' for path in with_torch if path in copies[:len(own)]]
            if merged:  # merged's module under its own name (the build defines TORCH_EXTENSION_NAME as base's)
                lines += ["#undef TORCH_EXTENSION_NAME\n", f"#define TORCH_EXTENSION_NAME {self.NAMES[1]}\n"]
                lines += [f'#include "{path}"\n' for path in with_torch if path in copies[len(own):]]
            unity = os.path.join(copy_dir, f"{self.NAME}.cpp")
            _write_if_changed(unity, "".join(lines))
            return [unity] + [path for path in copies if path not in with_torch]

        def _includes_torch(self, path: str, seen: set) -> bool:
            """Whether ``path`` includes a torch header, itself or through a header of the op's folders."""
            seen.add(path)
            with open(path, encoding="utf-8") as f:
                names = _INCLUDE.findall(f.read())
            for name in names:
                if name.startswith("torch/"):
                    return True
                for folder in [os.path.dirname(path)] + self.include_paths():
                    header = os.path.join(folder, name)
                    if os.path.isfile(header):
                        if header not in seen and self._includes_torch(header, seen):
                            return True
                        break
            return False

        def cxx_args(self):
            # Without DeepSpeed's -g: debug information for torch's templates was a quarter of async_io's compile
            # (35 s of CPU -> 27 s on CI's cores); nothing in the tests reads it. The code compiled is the same.
            return [arg for arg in super().cxx_args() if arg != "-g"]

        def load(self, verbose=False):
            return self.jit_load(verbose)

    OneUnit.__name__ = OneUnit.__qualname__ = f"OneUnit{base.__name__}"
    return OneUnit


def load_nvme_ops(verbose: bool = False):
    """Build (once: cached in TORCH_EXTENSIONS_DIR) and load async_io and pin_memory from one library; register them
    as DeepSpeed's ``async_io`` and ``pin_memory`` ops in this process. Returns the async_io module."""
    import importlib.util

    from deepspeed.ops import op_builder
    from deepspeed.ops.op_builder.builder import OpBuilder
    builder = _one_unit_builder(op_builder.AsyncIOBuilder, merged=op_builder.PinMemoryBuilder,
                                replaced=("deepspeed_pin_tensor_client.cpp",))()
    aio = builder.load(verbose)
    spec = importlib.util.spec_from_file_location(builder.NAMES[1], aio.__file__)  # the same library's other module
    pin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pin)
    OpBuilder._loaded_ops[op_builder.PinMemoryBuilder.NAME] = pin
    OpBuilder._loaded_ops[op_builder.AsyncIOBuilder.NAME] = aio
    return aio


def load(builder_name: str):
    """Load DeepSpeed's op ``builder_name`` (``"AsyncIOBuilder"``) as the tests do: the NVMe ops as above, any
    other through DeepSpeed's own builder; ``"hybridlm"``: the project's fused CPU ops, through its own build."""
    if builder_name == "hybridlm":
        from hybridlm.config import FUSED_OPS
        from hybridlm.ops import select_kernels
        return select_kernels(FUSED_OPS, require=False, device="cpu", log=lambda _: None)
    if builder_name == "AsyncIOBuilder":
        return load_nvme_ops()
    from deepspeed.ops import op_builder
    builder = getattr(op_builder, builder_name)()
    return builder.load(verbose=False) if builder.is_compatible(False) else None


if __name__ == "__main__":  # python tests/deepspeed_ops.py AsyncIOBuilder hybridlm: the builds conftest.py starts
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in sys.argv[1:]:
        try:
            load(name)
        except Exception:  # noqa: BLE001 - the test that loads the op reports its failure
            pass
