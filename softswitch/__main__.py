from netagg.softswitch.cli import main

raise SystemExit(main())
