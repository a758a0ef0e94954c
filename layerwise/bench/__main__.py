from layerwise.bench.cli import main

raise SystemExit(main())
