"""``python -m nbgen.bench``: the throughput benchmark (nbgen.bench.run)."""
from nbgen.bench.run import main

if __name__ == "__main__":
    main()
