"""Checks what the built sdist and wheel hold (called by .ci/run with the dist folder).

The wheel: the `jaxscale` package (every `jaxscale/*.py` of the source tree and `py.typed`) and
its metadata, nothing else (no tests, examples, benchmarks or docs). The sdist: the same package
plus what building and reading it needs (pyproject.toml, README.md, LICENSE, CHANGELOG.md, PKG-INFO).
Both carry the version of `jaxscale.__version__`.
"""

import email.parser
import pathlib
import re
import sys
import tarfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def fail(message):
  sys.exit(f"check_dist: {message}")


def main(dist):
  version = re.search(r'^__version__ = "(.+)"$', (ROOT / "jaxscale/__init__.py").read_text(), re.M)[1]
  package = {f"jaxscale/{p.name}" for p in (ROOT / "jaxscale").glob("*.py")} | {"jaxscale/py.typed"}
  wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
  if [w.name for w in wheels] != [f"jaxscale-{version}-py3-none-any.whl"] or [s.name for s in sdists] != [
      f"jaxscale-{version}.tar.gz"]:
    fail(f"expected one wheel and one sdist of version {version}, found {sorted(p.name for p in dist.iterdir())}")

  with zipfile.ZipFile(wheels[0]) as wheel:
    names = set(wheel.namelist())
    info = f"jaxscale-{version}.dist-info/"
    metadata = email.parser.Parser().parsestr(wheel.read(info + "METADATA").decode())
  payload = {n for n in names if not n.startswith(info)}
  if payload != package:
    fail(f"the wheel should hold exactly {sorted(package)}; extra {sorted(payload - package)}, "
         f"missing {sorted(package - payload)}")
  if f"{info}licenses/LICENSE" not in names:
    fail("the wheel lacks its LICENSE")
  if metadata["Version"] != version or metadata["License-Expression"] != "Apache-2.0":
    fail(f"wheel metadata: version {metadata['Version']}, license {metadata['License-Expression']}")
  extras = set(metadata.get_all("Provides-Extra"))
  if not {"flax", "test", "docs"} <= extras:
    fail(f"wheel metadata: extras {sorted(extras)}")

  with tarfile.open(sdists[0]) as sdist:
    top = f"jaxscale-{version}/"
    files = {m.name.removeprefix(top) for m in sdist.getmembers() if m.isfile()}
  needed = package | {"pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "PKG-INFO"}
  if not needed <= files:
    fail(f"the sdist lacks {sorted(needed - files)}")
  unwanted = {f for f in files if f.split("/")[0] in ("tests", "examples", "benchmarks", "docs", ".ci")}
  if unwanted:
    fail(f"the sdist should not hold {sorted(unwanted)}")
  print(f"check_dist: {wheels[0].name} ({len(payload)} files) and {sdists[0].name} ({len(files)} files) "
        "are as expected")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
