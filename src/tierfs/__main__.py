from tierfs.cli import main

raise SystemExit(main())
