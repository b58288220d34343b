from specdec.kernels import main

raise SystemExit(main())
