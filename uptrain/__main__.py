from uptrain.cli import main

raise SystemExit(main())
