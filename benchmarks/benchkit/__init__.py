"""What the benchmark scripts share: where a result comes from (``provenance``). The scripts
import it as ``benchkit`` (``python benchmarks/NAME.py`` puts ``benchmarks/`` on the path);
tests do not import benchmarks."""
