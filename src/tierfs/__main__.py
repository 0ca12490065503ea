from tierfs.commands.cli import main

raise SystemExit(main())
