# The Python packages the test suites need, for tools/test.sh and
# tools/test_torch_version.sh (sourced by both, so that the two install the
# same list). transformers is not here: it is optional (only its integration
# tests need it) and each script installs it on its own terms.

# The pip specs of the needed packages that python `$1` lacks, one per line.
test_deps_missing() {
  local py=$1 spec
  for spec in pytest:pytest hypothesis:hypothesis numpy:numpy pybind11:pybind11 wheel:wheel; do
    "$py" -c "import ${spec%%:*}" 2>/dev/null || echo "${spec#*:}"
  done
  # setuptools, and a recent one: a venv's bundled setuptools (65.5 with
  # Python 3.11) and a current wheel print wheel's FutureWarning on every
  # build (setuptools took bdist_wheel over in 70.1).
  "$py" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 71)' \
    2>/dev/null || echo "setuptools>=71"
}
