"""``python -m shaderdsl.runtime adapters``: list the adapters wgpu can see."""
import sys

from .device import adapters_report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["adapters"]:
        print("usage: python -m shaderdsl.runtime adapters", file=sys.stderr)
        return 2
    print(adapters_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
