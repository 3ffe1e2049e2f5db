from examples.fastapi_app.app import main

main()
