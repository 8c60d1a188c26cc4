// E2B's JavaScript quickstart (e2b.dev/docs/quickstart), unchanged except that the docs'
// placeholder path is one the sandbox may write (/tmp). Only the environment printed by
// `agentvm e2b env` points it at agent-vm.
import { Sandbox } from 'e2b'

const sbx = await Sandbox.create() // By default the sandbox is alive for 5 minutes
const execution = await sbx.commands.run("echo 'Hello, World!'")
console.log(execution.stdout)

await sbx.files.write('/tmp/hello.txt', 'hello from js')
console.log('read:', await sbx.files.read('/tmp/hello.txt'))
const files = await sbx.files.list('/tmp')
console.log('list:', files.map((f) => f.name).join(','))

const bg = await sbx.commands.run('echo bg; sleep 1; echo done', { background: true })
const res = await bg.wait()
console.log('background:', JSON.stringify(res.stdout))

await sbx.kill()
console.log('killed')
