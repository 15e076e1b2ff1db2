from ringflow.cli import main

raise SystemExit(main())
